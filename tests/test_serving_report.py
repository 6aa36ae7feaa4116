"""The serving sweep's report (torch_kvops/bench/serving_report.py) on synthetic records:
ratios, the comparison with the replicas, warnings, the plot. The sweep itself is a
benchmark (python -m torch_kvops.bench.serving_sweep), not a test."""
from __future__ import annotations

import os

import pytest

from torch_kvops.bench import serving_report
from torch_kvops.bench.serving_sweep import kv_bytes_per_token, parse_args, prompts_for

pytestmark = [pytest.mark.unit]


def _rec(config: str, rate: float, ttft: float, tpot: float, goodput: float, **extra) -> dict:
    rec = {"config": config, "label": config, "rate": rate, "num_prompts": 8, "completed": 8,
           "failed": 0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot,
           "p99_tpot_ms": 2 * tpot, "request_goodput": goodput, "request_throughput": 1.0,
           "load1": 2.0, "errors": []}
    if config != "mono-rr":
        rec.update(decode_local_prompt_tokens=8, kv_from_prefill=True)
    rec.update(extra)
    return rec


def _saved(records) -> dict:
    args = vars(parse_args([]))
    model = {"num_hidden_layers": 16, "hidden_size": 256, "num_key_value_heads": 4, "head_dim": 64}
    return {"started": "now", "link": "1gbit", "args": args, "records": records, "total_s": 1.0,
            "model": dict(model, kv_bytes_per_token=kv_bytes_per_token(model))}


def test_ratios_comparison_and_warnings(tmp_path):
    records = []
    for rate in (1.0, 2.0):
        records += [_rec("mono-rr", rate, 400, 20, 1.0), _rec("pd-concurrent", rate, 420, 15, 0.9),
                    _rec("pd-dfirst", rate, 400, 15, 0.9), _rec("pd-router", rate, 660, 15, 0.9),
                    _rec("pd-after-forward", rate, 600, 15, 0.9)]
    records.append(_rec("pd-dfirst", 4.0, 900, 30, 0.5, decode_local_prompt_tokens=3000,
                        kv_from_prefill=False))
    saved = _saved(records)
    assert kv_bytes_per_token(saved["model"]) == 32 * 1024
    text = serving_report.render(saved)
    assert "pd-concurrent / pd-dfirst: median over rates 1.05 (goal <= 1.05: met)" in text
    assert "pd-router / pd-after-forward: median over rates 1.10 (goal <= 1.10: met)" in text
    assert "TPOT p50 15.0 vs 20.0 ms (P/D better by 25%)" in text
    assert "goodput 0.90 vs 1.00 req/s (P/D worse by 10%)" in text
    assert "3000 / 8 **not from P**" in text and "D computed 3000 prompt tokens" in text
    png = serving_report.plot(saved, os.path.join(tmp_path, "p.png"))
    assert os.path.getsize(png) > 1000


def test_goal_missed_is_reported():
    saved = _saved([_rec("pd-concurrent", 1.0, 600, 15, 1), _rec("pd-dfirst", 1.0, 400, 15, 1)])
    assert "median over rates 1.50 (goal <= 1.05: NOT met)" in serving_report.render(saved)


def test_prompts_per_point_and_quick_mode():
    args = parse_args([])
    assert [prompts_for(r, args) for r in (0.5, 1, 2, 4, float("inf"))] == [8, 12, 24, 24, 24]
    quick = parse_args(["--quick"])
    assert quick.rates == "2" and prompts_for(2.0, quick) == 4

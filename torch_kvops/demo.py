"""Disaggregated prefill/decode on a paged-KV Llama, over Mooncake TCP on loopback.

    python -m torch_kvops.demo [--layers 16 --prompt-len 2048 ...] [--device cuda]

Two processes: this one is the prefill instance (producer), a spawned one is the
decode instance (consumer). The decode side allocates blocks for each request and
waits; prefill runs the prompts and ``save_kv_layer`` pushes every layer as soon as it
is written; decode then generates greedily from the received KV. The same prompts run
monolithically in this process first: the tokens must be identical.

Compared in one run, interleaved and repeated (medians): layer-wise push vs pushing
all layers after the forward, eager and torch.compile'd prefill, plus the forward
alone and the transfer alone. The last line of output is one JSON object.

By default, where the machine allows it (root: CAP_NET_ADMIN and CAP_SYS_ADMIN, and
``ip``/``tc``), both processes run inside a network namespace whose loopback is shaped to
1 Gbit/s (torch_kvops/emulated_link.py): the KV then takes about half as long to move
as the forward takes to compute it, the regime of a long prompt between two GPU hosts,
where layer-wise push matters. On plain loopback the transfer is a few percent of the
forward and there is little to hide. ``--link RATE[,DELAY]`` picks another link,
``--link none`` plain loopback; the report says which regime the run was in.

``--device cuda`` runs both models and their KV caches on the GPU (both processes may
share one), the model on torch's default stream; the connector stages each layer
through pinned host memory on its own stream, so the transfer overlaps the forward.
What users feel is reported first: how long after the forward ended the decode side
still waited for KV ("exposed transfer"), layer-wise vs after-forward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from .testing.demo_sides import PrefillSide, decode_main, reference_tokens
from .testing.paged_llama import LlamaConfig, blocks_needed
from .testing.worker import WorkerProcess


def _progress(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                      block_size=args.block_size, vocab_size=2048, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    per_round = sum(blocks_needed(len(p) + args.new_tokens, cfg.block_size) for p in prompts)
    args.num_blocks = 3 * per_round + 8
    cfg_kwargs = {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                "intermediate_size", "block_size", "vocab_size", "seed")}
    kv_mib = args.layers * per_round * cfg.bytes_per_block() / 2**20
    _progress(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV heads; "
              f"{args.prompts} prompt(s) x {args.prompt_len} tokens; KV to move ~{kv_mib:.0f} MiB; "
              f"torch threads {args.threads}")
    _progress("starting the decode process")
    decode = WorkerProcess(decode_main, (cfg_kwargs, args.num_blocks, args.threads, args.device),
                           "decode", timeout=300)
    side = PrefillSide(args, decode, cfg, prompts)
    flavors = list(side.forwards)
    try:
        refs = {}
        for flavor in flavors:
            _progress(f"monolithic reference ({flavor}{', compiling: about a minute' if flavor == 'compiled' else ''})")
            refs[flavor] = reference_tokens(side, flavor)
        _progress("warm-up of every scenario (compiles the hooked graph)")
        tokens_match = True
        for flavor in flavors:
            for layerwise in (True, False):
                _, _, tokens, _ = side.disaggregated(flavor, layerwise, verify=refs[flavor])
                tokens_match &= tokens == refs[flavor]
        side.transfer_only()
        samples: Dict[str, List[float]] = {}
        traces = {}
        for rep in range(args.repeats):
            _progress(f"round {rep + 1}/{args.repeats}")
            for flavor in flavors:
                samples.setdefault(f"prefill_compute_s[{flavor}]", []).append(side.compute_only(flavor))
                for layerwise, name in ((True, "layerwise"), (False, "after_forward")):
                    verify = refs[flavor] if rep == args.repeats - 1 else None
                    ready, fwd, tokens, trace = side.disaggregated(flavor, layerwise, verify)
                    if verify is not None:
                        tokens_match &= tokens == refs[flavor]
                    samples.setdefault(f"kv_ready_{name}_s[{flavor}]", []).append(ready)
                    samples.setdefault(f"forward_{name}_s[{flavor}]", []).append(fwd)
                    traces[f"{name}[{flavor}]"] = {"forward_s": fwd, "kv_ready_s": ready, "layers": trace}
            samples.setdefault("transfer_s", []).append(side.transfer_only())
        med = {k: statistics.median(v) for k, v in samples.items()}
        stats = side.conn.stats()
    finally:
        side.close()
        decode.stop()

    result = {"tokens_match": bool(tokens_match),
              "tokens_compiled_equal_eager": refs.get("compiled") == refs["eager"] if "compiled" in refs else None}
    for flavor in flavors:
        result[flavor] = _summarize(samples, flavor)
    main = result["eager"]
    result.update({"prefill_compute_s": main["prefill_compute_s"], "transfer_s": med["transfer_s"],
                   "transfer_over_compute": med["transfer_s"] / main["prefill_compute_s"],
                   "regime": regime(med["transfer_s"], main["prefill_compute_s"]),
                   "link": args.link_note,
                   **{k: main[k] for k in ("kv_ready_layerwise_s", "kv_ready_after_forward_s",
                                           "exposed_layerwise_ms", "exposed_after_forward_ms",
                                           "hidden_fraction", "hidden_fraction_range")},
                   "config": {k: v for k, v in vars(args).items() if k != "json_out"},
                   "kv_mib": kv_mib, "samples": samples, "traces": traces,
                   "sender_stats": {k: stats[k] for k in ("bytes_sent", "layers_sent", "retries",
                                                           "transport_errors", "staged_writes")}})
    return result


# The regime where layer-wise push matters: the transfer is a sizeable part of the
# forward (an 8k-token prompt of an 8B model: ~1 GiB of KV, ~0.34 s over 25 Gbit/s,
# against 0.5-1 s of prefill on a GPU).
TRANSFER_MATTERS = 0.3
# The default link: the default model's 64 MiB of KV take ~0.55 s against ~1.2 s of forward.
DEFAULT_LINK = "1gbit"


def regime(transfer_s: float, compute_s: float) -> str:
    if transfer_s > compute_s:
        return "transfer-bound"
    if transfer_s >= TRANSFER_MATTERS * compute_s:
        return "transfer matters"
    return "compute-bound"


def choose_link(choice: str) -> Tuple[Optional[str], str]:
    """(the link to run in, or None for plain loopback; why), for ``--link``."""
    from .emulated_link import LinkError, check_prerequisites

    if choice == "none":
        return None, "plain loopback (--link none)"
    if choice != "auto":
        return choice, f"emulated link {choice}"
    try:
        check_prerequisites()
    except LinkError as exc:
        return None, f"plain loopback: no emulated link here ({exc})"
    return DEFAULT_LINK, (f"emulated link {DEFAULT_LINK} (the default where the machine allows "
                          "it; --link none for plain loopback)")


def _summarize(samples: Dict[str, List[float]], flavor: str) -> dict:
    """Medians and, per round, what the user feels: how long after its own forward
    ended the decode side still waited for KV (negative: the KV was complete before the
    forward returned). Each round's layer-wise and after-forward runs are adjacent, so
    their difference is free of cross-run noise. The hidden fraction is that difference
    over min(compute, transfer), per round; above 1 is noise, so it is reported clipped
    to [0, 1] with the raw range across rounds."""
    def col(name: str) -> List[float]:
        return samples[f"{name}[{flavor}]"]

    exposed = {name: [r - f for r, f in zip(col(f"kv_ready_{name}_s"), col(f"forward_{name}_s"))]
               for name in ("layerwise", "after_forward")}
    hidden = [(a - lw) / min(c, t) for a, lw, c, t in zip(
        exposed["after_forward"], exposed["layerwise"], col("prefill_compute_s"), samples["transfer_s"])]

    def ms(values: List[float]) -> dict:
        return {"median": 1e3 * statistics.median(values), "min": 1e3 * min(values),
                "max": 1e3 * max(values)}

    return {"prefill_compute_s": statistics.median(col("prefill_compute_s")),
            "forward_with_layerwise_push_s": statistics.median(col("forward_layerwise_s")),
            "kv_ready_layerwise_s": statistics.median(col("kv_ready_layerwise_s")),
            "kv_ready_after_forward_s": statistics.median(col("kv_ready_after_forward_s")),
            "exposed_layerwise_ms": ms(exposed["layerwise"]),
            "exposed_after_forward_ms": ms(exposed["after_forward"]),
            "hidden_fraction": min(1.0, max(0.0, statistics.median(hidden))),
            "hidden_fraction_range": [min(hidden), max(hidden)]}


def print_report(result: dict) -> None:
    def exposed(entry: dict, key: str) -> str:
        e = entry[key]
        return f"{e['median']:+.1f} ({e['min']:+.1f}..{e['max']:+.1f})"

    print()
    print(f"{'':38} {'eager':>24} {'compiled':>24}")
    rows = [("prefill forward alone (s)", "prefill_compute_s"),
            ("forward with layer-wise hooks (s)", "forward_with_layerwise_push_s"),
            ("KV ready, layer-wise push (s)", "kv_ready_layerwise_s"),
            ("KV ready, push after forward (s)", "kv_ready_after_forward_s")]
    for label, key in rows:
        cols = [f"{result[f][key]:.3f}" if f in result else "-" for f in ("eager", "compiled")]
        print(f"{label:38} " + " ".join(f"{c:>24}" for c in cols))
    for label, key in (("exposed transfer, layer-wise (ms)", "exposed_layerwise_ms"),
                       ("exposed transfer, after forward (ms)", "exposed_after_forward_ms")):
        cols = [exposed(result[f], key) if f in result else "-" for f in ("eager", "compiled")]
        print(f"{label:38} " + " ".join(f"{c:>24}" for c in cols))
    print(f"{'transfer of all layers alone (s)':38} {result['transfer_s']:24.3f}")
    print(f"link: {result['link']}")
    print(f"regime: {result['regime']} (transfer {result['transfer_s']:.3f} s = "
          f"{100 * result['transfer_over_compute']:.0f}% of the forward's {result['prefill_compute_s']:.3f} s; "
          f"layer-wise push matters from {100 * TRANSFER_MATTERS:.0f}%)")
    print(f"tokens identical to the monolithic run: {result['tokens_match']}")
    lo, hi = result["hidden_fraction_range"]
    print(f"layer-wise push hid {result['hidden_fraction'] * 100:.0f}% of min(compute, transfer) "
          f"(median over rounds, clipped to [0, 1]; raw range {lo:.2f}..{hi:.2f}; goal >= 80%)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process; 1 leaves a core to the transport on 2-core machines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both models and their KV caches live (cuda: the model runs on "
                        "torch's default stream)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--link", default="auto", metavar="RATE[,DELAY]|auto|none",
                   help=f"run both processes in an emulated link (network namespace, needs root); "
                        f"auto: {DEFAULT_LINK} where the machine allows it, else plain loopback")
    p.add_argument("--link-timeout", type=float, default=3600.0, help="bound of the run inside the link, s")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    link, args.link_note = choose_link(args.link)
    if link is not None:
        from .emulated_link import current_link, enter_link

        if current_link() is None:
            _progress(f"running inside an {args.link_note}")
        rest = list(sys.argv[1:] if argv is None else argv)
        # re-run inside the link with the link named, so "auto" resolves once
        enter_link(link, [sys.executable, "-m", "torch_kvops.demo", *_without_link(rest), "--link", link],
                   args.link_timeout)
    result = run(args)
    print_report(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    summary = {k: v for k, v in result.items() if k not in ("samples", "traces")}
    print(json.dumps(summary))
    return 0 if result["tokens_match"] else 1


def _without_link(argv: List[str]) -> List[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--link":
            skip = True
        elif not arg.startswith("--link="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())

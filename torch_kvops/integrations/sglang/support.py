"""What the ``kvops`` SGLang backend moves, and what it refuses with a clear error:
at start-up what it never moves (:func:`check_supported`), and per room a pair of
servers whose ranks do not line up (:func:`tp_mismatch`). No SGLang import here."""
from __future__ import annotations


def check_supported(args, server_args) -> None:
    """What this backend does not move yet fails at start-up, not in a transfer."""
    missing = []
    if str(getattr(server_args, "device", "cpu")) != "cpu":
        missing.append(f"device {server_args.device!r} (host KV caches only so far)")
    if getattr(args, "num_draft_entries", 0):
        missing.append("speculative decoding's draft KV")
    if getattr(args, "state_types", None):
        missing.append(f"state pools {args.state_types}")
    # tensor parallelism moves each rank's pages to its peer rank (equal attention TP
    # on both sides, or MLA: KvopsKVReceiver); other splits of the model are not built
    for name, what in (("pp_size", "pipeline parallelism"), ("attn_cp_size", "context parallelism"),
                       ("attn_dp_size", "data-parallel attention")):
        if getattr(server_args, name, 1) != 1:
            missing.append(what)
    if missing:
        raise NotImplementedError("the kvops SGLang backend does not support "
                                  + ", ".join(missing) + " yet")


def tp_mismatch(prefill_tp: int, decode_tp: int, latent: bool) -> str:
    """Why a room between these attention TP sizes cannot move, or "". A prefill rank
    pushes its own pages whole: with MHA its rank holds its share of the KV heads, so
    only equal sizes line up (slicing heads is not built); an MLA rank holds the whole
    latent, and SGLang's rank mapping names one prefill rank per decode rank."""
    if latent or prefill_tp == decode_tp:
        return ""
    return (f"the kvops backend moves KV between equal attention TP sizes only (MLA: any): "
            f"prefill attention TP {prefill_tp}, decode {decode_tp}")

"""What the ``kvops`` SGLang backend refuses at start-up, with a clear error
(:func:`check_supported`; a room between attention TP sizes that do not split the
model's KV heads fails on the decode side: :meth:`.heads.RankHeads.tp_problem`). No
SGLang import here."""
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
    # tensor parallelism moves each rank's KV heads (MHA) or latent (MLA) to the decode
    # ranks that hold them (heads.py, transfers.py); other splits of the model are not built
    for name, what in (("pp_size", "pipeline parallelism"), ("attn_cp_size", "context parallelism"),
                       ("attn_dp_size", "data-parallel attention")):
        if getattr(server_args, name, 1) != 1:
            missing.append(what)
    if missing:
        raise NotImplementedError("the kvops SGLang backend does not support "
                                  + ", ".join(missing) + " yet")

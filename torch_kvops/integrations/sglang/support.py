"""What the ``kvops`` SGLang backend refuses, with a clear error: at start-up what it
never moves (:func:`check_supported`), and per room, on the decode side before its
destination goes out, attention TP sizes it cannot move between (:func:`tp_problem`).
No SGLang import here."""
from __future__ import annotations

from typing import Optional

from .heads import RankHeads
from .settings import CONFIG_ENV
from .swa_pool import SWA_STATE


def check_supported(args, server_args, mha_unit: str = "page", latent: bool = False) -> None:
    """What this backend does not move yet fails at start-up, not in a transfer."""
    missing = []
    if str(getattr(server_args, "device", "cpu")) != "cpu":
        missing.append(f"device {server_args.device!r} (host KV caches only so far)")
    if getattr(args, "num_draft_entries", 0):
        missing.append("speculative decoding's draft KV")
    states = [getattr(state, "value", state) for state in getattr(args, "state_types", None) or []]
    others = [s for s in states if s != SWA_STATE]
    if others:
        missing.append(f"state pools {others}")
    if SWA_STATE in states and (latent or mha_unit != "page"):
        # the hybrid pool's windows move by page (swa_pool.py), of MHA pools
        missing.append("a hybrid sliding-window pool " + ("of MLA" if latent else "with mha_unit "
                       f"{mha_unit!r}") + " (moved by page only; or --disable-hybrid-swa-memory "
                       "on every server of the fleet)")
    # tensor parallelism moves each rank's KV heads (MHA) or latent (MLA) to the decode
    # ranks that hold them (heads.py, transfers.py); other splits of the model are not built
    for name, what in (("pp_size", "pipeline parallelism"), ("attn_cp_size", "context parallelism"),
                       ("attn_dp_size", "data-parallel attention")):
        if getattr(server_args, name, 1) != 1:
            missing.append(what)
    if missing:
        raise NotImplementedError("the kvops SGLang backend does not support "
                                  + ", ".join(missing) + " yet")


def tp_problem(latent: bool, heads: Optional[RankHeads], prefill_tp: int, decode_tp: int) -> str:
    """Why a room from a prefill server of attention TP ``prefill_tp`` cannot come to
    this decode rank, or "". An MLA rank holds the whole latent: any sizes. An MHA rank
    holds its share of the KV heads: moved by page (``heads`` None) only between equal
    sizes; by head, between sizes that split the heads."""
    if latent:
        return ""
    if heads is not None:
        return heads.tp_problem(prefill_tp)
    if prefill_tp == decode_tp:
        return ""
    return (f"the kvops backend moves MHA KV by page between equal attention TP sizes only "
            f"(prefill {prefill_tp}, decode {decode_tp}): set \"mha_unit\": \"head\" in "
            f"${CONFIG_ENV} on every server of the fleet")

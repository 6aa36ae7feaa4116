"""Every SGLang name the ``kvops`` backend relies on, in one place, read from SGLang
0.5.23 (``disaggregation/base/conn.py``, ``common/conn.py``, ``common/utils.py``,
``utils.py``, ``arg_groups/choices.py``, ``plugins/hook_registry.py``,
``configs/model_config.py``, ``layers/radix_attention.py``, ``server_args.py``).

:func:`check` compares the installed SGLang with what was read: the version, and the
signatures of the methods the backend overrides or calls. It runs when the plugin
installs the backend, so a changed SGLang fails loudly at start-up, not in a transfer.
The version check also guards the one behaviour relied on beyond names: which prefill
ranks SGLang tells a decode rank's destination to (``CommonKVReceiver``'s rank mapping,
mirrored by :func:`.heads.destination_ranks`), and that with a decode-side radix prefix
the prefill takes its length (``pop_decode_prefix_len``) before the room's first forward
and counts the pages it sends from there (``send()``'s index slices).
"""
from __future__ import annotations

import inspect
import pkgutil
from typing import Callable, Dict, List, Optional, Set, Tuple

import sglang
from sglang.srt.arg_groups.choices import (DISAGG_TRANSFER_BACKEND_CHOICES,
                                           add_disagg_transfer_backend_choices)
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (ABORT_TAG, AbortNotification,
                                                   CommonKVBootstrapServer, CommonKVManager,
                                                   CommonKVReceiver, CommonKVSender,
                                                   PrefillServerInfo)
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

READ_FROM = "0.5.23"

# hooked (plugins/hook_registry.py), for the layer-wise push (layerwise.py)
BOOTSTRAP_QUEUE_ADD = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
SET_KV_BUFFER = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer"
# MLA (DeepSeek): one latent buffer per layer, written by either method
SET_LATENT_BUFFER = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_kv_buffer"
SET_LATENT_PARTS = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_mla_kv_buffer"
KV_WRITES = (SET_KV_BUFFER, SET_LATENT_BUFFER, SET_LATENT_PARTS)
HOOKED: Dict[str, List[str]] = {
    BOOTSTRAP_QUEUE_ADD: ["req", "num_kv_heads"],
    MODEL_FORWARD: ["forward_batch"],
    SET_KV_BUFFER: ["layer", "loc_info", "cache_k", "cache_v"],  # layer_id_override: keyword
    SET_LATENT_BUFFER: ["layer", "loc_info", "cache_k", "cache_v", "layer_id_override"],
    SET_LATENT_PARTS: ["layer", "loc_info", "cache_k_nope", "cache_k_rope", "layer_id_override"],
}
# read in the hooks: ForwardBatch fields and the model runner's token table
FORWARD_BATCH_FIELDS = ("rids", "req_pool_indices", "extend_prefix_lens_cpu",
                        "extend_seq_lens_cpu", "forward_mode")

__all__ = ["ABORT_TAG", "AbortNotification", "CommonKVBootstrapServer", "CommonKVManager",
           "CommonKVReceiver", "CommonKVSender", "DISAGG_TRANSFER_BACKEND_CHOICES",
           "DisaggregationMode", "HookRegistry", "HookType", "KVArgs", "KVClassType", "KVPoll",
           "TransferBackend", "add_disagg_transfer_backend_choices", "check", "READ_FROM",
           "BOOTSTRAP_QUEUE_ADD", "MODEL_FORWARD", "KV_WRITES", "PREFILL_MANAGER_ATTRIBUTES",
           "DECODE_MANAGER_ATTRIBUTES", "RECEIVER_ATTRIBUTES", "check_attributes", "total_kv_heads",
           "sliding_windows", "decode_reads_windows_only", "hybrid_pool"]

# method -> the parameters (in order, after self) the backend passes or receives
SIGNATURES: Dict[str, List[str]] = {
    "CommonKVManager.__init__": ["args", "disaggregation_mode", "server_args", "is_mla_backend"],
    "CommonKVManager.update_status": ["bootstrap_room", "status"],
    "CommonKVManager.check_status": ["bootstrap_room"],
    "CommonKVManager.record_failure": ["bootstrap_room", "failure_reason"],
    "CommonKVManager._make_worker_recv": ["socket", "timeout_ms"],
    "CommonKVManager._send_multipart_locked": ["endpoint", "parts", "is_ipv6"],
    "CommonKVManager.build_receiver_registration_message": [],
    # decode: SGLang's heartbeat to each prefill's bootstrap server, and what it calls
    # when one stops answering (the backend keeps its rooms for the connector's outcome)
    "CommonKVManager._start_heartbeat_checker_thread": [],
    "CommonKVManager._handle_node_failure": ["failed_bootstrap_addr"],
    # called after each answered heartbeat: a restarted prefill's ranks are checked there
    "CommonKVManager._on_heartbeat_success": ["bootstrap_addr"],
    "CommonKVManager.build_receiver_metadata_message": [
        "bootstrap_room", "required_dst_info_num", "kv_indices", "aux_index", "state_indices",
        "decode_prefix_len", "is_dummy", "device_kv_indices"],
    "CommonKVSender.send": ["kv_indices", "state_indices", "num_kv_tokens", "indices_event"],
    "CommonKVSender.abort": [],
    # the decode side's radix prefix, taken before the room's first forward
    "CommonKVSender.pop_decode_prefix_len": [],
    "CommonKVSender.poll": [],
    "CommonKVReceiver.init": ["prefill_dp_rank"],
    "CommonKVReceiver.send_metadata": ["kv_indices", "aux_index", "state_indices",
                                       "decode_prefix_len", "destination", "device_kv_indices"],
    "CommonKVReceiver.abort": [],
    "CommonKVReceiver.poll": [],
    "CommonKVReceiver.ensure_abort_notified": ["force_arm"],
    # the socket SGLang's receiver sends its abort notice on (conn.SignedAborts signs it)
    "CommonKVReceiver._connect_to_bootstrap_server": ["bootstrap_info"],
}
# attributes of a CommonKVManager instance the backend reads: in both roles, and in one
MANAGER_ATTRIBUTES = ("kv_args", "local_ip", "rank_port", "server_socket", "request_status",
                      "attn_tp_size", "attn_tp_rank", "is_mla_backend", "server_args")
PREFILL_MANAGER_ATTRIBUTES = MANAGER_ATTRIBUTES + ("transfer_infos", "req_to_decode_prefix_len")
DECODE_MANAGER_ATTRIBUTES = MANAGER_ATTRIBUTES + ("connection_lock", "addr_to_rooms_tracker",
                                                  "connection_pool", "prefill_info_table")
# attributes of a CommonKVReceiver instance the backend reads (after its init)
RECEIVER_ATTRIBUTES = ("kv_mgr", "bootstrap_room", "conclude_state", "prefill_info")
# fields of PrefillServerInfo (a decode rank's view of a prefill server) the backend reads
PREFILL_INFO_FIELDS = ("attn_tp_size", "target_tp_ranks")
# KVPoll values the backend reports
POLL_STATES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")


def total_kv_heads(server_args) -> int:
    """The model's KV heads over all attention TP ranks (a decode manager's ``KVArgs``
    lacks them: SGLang sets them there only for its staging buffers, after the manager)."""
    return ModelConfig.from_server_args(server_args).get_total_num_kv_heads()


def sliding_windows(model) -> Dict[int, int]:
    """Per attention layer of ``model`` (SGLang's ``RadixAttention``, by its global
    ``layer_id``), its ``sliding_window_size`` (-1: full attention)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    found = {}
    for module in model.modules():
        if isinstance(module, RadixAttention):
            window = getattr(module, "sliding_window_size", None)
            layer_id = getattr(module, "layer_id", None)
            if type(window) is not int or type(layer_id) is not int:
                raise RuntimeError("the kvops SGLang backend does not match this SGLang: its "
                                   "RadixAttention has no int layer_id and sliding_window_size")
            found[layer_id] = window
    return found


def hybrid_pool(runner) -> Tuple[object, Optional[Callable], int]:
    """A prefill model runner's hybrid sliding-window pool: (its window part, the
    translation of full-pool token slots to that part's, as SGLang's prefill makes it
    for a room's window; the window in tokens). The translation is None where SGLang
    names the window otherwise (a pool with a ``request_window``): the room's window
    then goes after the forward, as SGLang names it."""
    pool = runner.token_to_kv_pool
    if getattr(pool, "request_window", None) is not None:
        return pool.swa_kv_pool, None, 0
    return (pool.swa_kv_pool, runner.token_to_kv_pool_allocator.translate_swa_indices_for_transfer,
            int(runner.sliding_window_size))


def decode_reads_windows_only(server_args) -> bool:
    """Whether a decode server reads a sliding layer's last window only, and never its
    earlier pages: it keeps no finished request's KV for later prompts (its radix
    cache: a later prompt sharing a start reads those pages), and its attention backend
    honours the layer's ``sliding_window_size``."""
    backend = getattr(server_args, "decode_attention_backend") or getattr(server_args, "attention_backend")
    return not getattr(server_args, DECODE_RADIX_CACHE) and backend not in READ_EVERY_TOKEN


DECODE_RADIX_CACHE = "disaggregation_decode_enable_radix_cache"  # a ServerArgs field
# a hybrid pool's allocator (mem_cache/allocator/swa.py), read by hybrid_pool (instance
# attributes of ModelRunner: token_to_kv_pool, token_to_kv_pool_allocator, sliding_window_size;
# of SWAKVPool: swa_kv_pool, request_window)
HYBRID_WINDOW_SLOTS = ("sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
                       ".translate_swa_indices_for_transfer")
# attention backends that ignore sliding_window_size (layers/attention/torch_flex_backend.py,
# wave_backend.py): a sliding layer reads every token there
READ_EVERY_TOKEN = ("flex_attention", "wave")


def check() -> None:
    """Raise RuntimeError naming every difference between the installed SGLang and
    what this backend was written against."""
    problems = []
    if sglang.__version__ != READ_FROM:
        problems.append(f"SGLang {sglang.__version__} is installed; the kvops backend was read "
                        f"from {READ_FROM}")
    classes = {"CommonKVManager": CommonKVManager, "CommonKVSender": CommonKVSender,
               "CommonKVReceiver": CommonKVReceiver}
    for name, expected in SIGNATURES.items():
        owner, method = name.split(".")
        fn = getattr(classes[owner], method, None)
        if fn is None:
            problems.append(f"{name} is gone")
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if params[:len(expected)] != expected:
            problems.append(f"{name}{tuple(params)} differs from the {tuple(expected)} read")
    for state in POLL_STATES:
        if not hasattr(KVPoll, state):
            problems.append(f"KVPoll.{state} is gone")
    for member in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER", "KVARGS"):
        if not hasattr(KVClassType, member):
            problems.append(f"KVClassType.{member} is gone")
    for target, expected in HOOKED.items():
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{target} is gone ({exc})")
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if params[:len(expected)] != expected:
            problems.append(f"{target}{tuple(params)} differs from the {tuple(expected)} read")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    fields = getattr(ForwardBatch, "__dataclass_fields__", {})
    problems += [f"ForwardBatch.{name} is gone" for name in FORWARD_BATCH_FIELDS if name not in fields]
    info_fields = getattr(PrefillServerInfo, "__dataclass_fields__", {})
    problems += [f"PrefillServerInfo.{name} is gone" for name in PREFILL_INFO_FIELDS
                 if name not in info_fields]
    if not callable(getattr(ModelConfig, "get_total_num_kv_heads", None)) \
            or "server_args" not in inspect.signature(ModelConfig.from_server_args).parameters:
        problems.append("ModelConfig.from_server_args(server_args).get_total_num_kv_heads() is gone")
    from sglang.srt.server_args import ServerArgs

    problems += [f"ServerArgs.{name} is gone" for name in
                 (DECODE_RADIX_CACHE, "decode_attention_backend", "attention_backend")
                 if not hasattr(ServerArgs, name)]
    for name in ("sglang.srt.layers.radix_attention.RadixAttention", HYBRID_WINDOW_SLOTS):
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name} is gone ({exc})")
    if not isinstance(DISAGG_TRANSFER_BACKEND_CHOICES, list):
        problems.append("DISAGG_TRANSFER_BACKEND_CHOICES is no longer a list")
    if problems:
        raise RuntimeError("the kvops SGLang backend does not match this SGLang: "
                           + "; ".join(problems))


_ATTRIBUTES_FOUND: Set[Tuple[type, Tuple[str, ...]]] = set()  # (class, names) seen whole


def check_attributes(instance, names: Tuple[str, ...]) -> None:
    """Instance attributes are set in SGLang's ``__init__``: checked on the first
    instance of each class (a receiver is made per room), before the backend reads
    any of them."""
    if (type(instance), names) in _ATTRIBUTES_FOUND:
        return
    missing = [name for name in names if not hasattr(instance, name)]
    if missing:
        raise RuntimeError(f"the kvops SGLang backend does not match this SGLang: its "
                           f"{type(instance).__name__} has no {', '.join(missing)}")
    _ATTRIBUTES_FOUND.add((type(instance), names))

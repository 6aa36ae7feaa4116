"""Adds the transfer backend ``kvops`` to SGLang (run by :func:`plugin.register` in
each SGLang process): the choice of ``--disaggregation-transfer-backend``, a member of
SGLang's ``TransferBackend`` enum, and the classes ``get_kv_class`` returns for it."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

NAME = "kvops"


def install() -> None:
    from . import internals as sgl

    sgl.check()
    if NAME not in sgl.DISAGG_TRANSFER_BACKEND_CHOICES:
        sgl.add_disagg_transfer_backend_choices([NAME])
    _add_enum_member(sgl.TransferBackend)
    sgl.HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class,
                              sgl.HookType.AROUND)
    # the layer-wise push (no-ops in a process without a kvops prefill manager)
    from . import layerwise

    hooks = [(sgl.BOOTSTRAP_QUEUE_ADD, layerwise.after_bootstrap_add, "AFTER"),
             (sgl.MODEL_FORWARD, layerwise.around_forward, "AROUND")]
    hooks += [(target, layerwise.after_set_kv_buffer, "AFTER") for target in sgl.KV_WRITES]
    for target, hook, kind in hooks:
        sgl.HookRegistry.register(target, hook, getattr(sgl.HookType, kind))


def _add_enum_member(enum_cls) -> None:
    """``TransferBackend("kvops")``: SGLang converts the argument with the enum, which
    has no public way to grow; the member is added to the existing class so every
    comparison with its other members stays valid."""
    if NAME in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_, member._value_ = NAME.upper(), NAME
    enum_cls._value2member_map_[NAME] = member
    enum_cls._member_map_[NAME.upper()] = member
    enum_cls._member_names_.append(NAME.upper())
    type.__setattr__(enum_cls, NAME.upper(), member)


def _get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) != NAME:
        return original(transfer_backend, class_type)
    from . import conn, internals as sgl

    return {sgl.KVClassType.KVARGS: sgl.KVArgs,
            sgl.KVClassType.MANAGER: conn.KvopsKVManager,
            sgl.KVClassType.SENDER: conn.KvopsKVSender,
            sgl.KVClassType.RECEIVER: conn.KvopsKVReceiver,
            sgl.KVClassType.BOOTSTRAP_SERVER: conn.KvopsKVBootstrapServer}.get(class_type)

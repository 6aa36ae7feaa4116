"""The ``kvops`` backend's classes as SGLang's ``get_kv_class`` hands them out: the
manager (:mod:`.manager`), and sender, receiver and bootstrap server on SGLang's
common ones, changed only where a room's end must wait for the connector."""
from __future__ import annotations

from . import internals as sgl
from .manager import KvopsKVManager
from .signing import SignedAborts
from .support import tp_problem

__all__ = ["KvopsKVBootstrapServer", "KvopsKVManager", "KvopsKVReceiver", "KvopsKVSender"]


class KvopsKVSender(sgl.CommonKVSender):
    """Prefill side of one room. An abort stops the room's push first: its pages go
    back to SGLang (Failed) only when the connector says nothing reads them."""

    kvops = True  # what the layer-wise hooks look for (layerwise.py)

    def abort(self) -> None:
        if self.conclude_state is None:
            self.kv_mgr.abort_room(self.bootstrap_room, "aborted by the prefill engine")

    def pop_decode_prefix_len(self) -> int:
        """SGLang takes the decode side's cached prefix here, before the room's first
        forward: the layer-wise push skips its tokens, as SGLang's ``send()`` does."""
        tokens = super().pop_decode_prefix_len()
        if self.kv_mgr.layerwise is not None:
            self.kv_mgr.layerwise.skip_decode_prefix(self.bootstrap_room, tokens)
        return tokens

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)


class KvopsKVReceiver(sgl.CommonKVReceiver):
    """Decode side of one room. Once its destination went out, the room ends only
    with the connector's outcome: SGLang's own waiting timeout and an abort do not
    hand its pages back while the prefill may still write them. A room between
    attention TP sizes the backend does not move fails at ``init`` (:func:`tp_problem`)."""

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state is None:  # (prefill_info is set only then)
            sgl.check_attributes(self, sgl.RECEIVER_ATTRIBUTES)
            problem = tp_problem(self.kv_mgr.is_mla_backend, self.kv_mgr.heads,
                                 self.prefill_info.attn_tp_size, self.kv_mgr.attn_tp_size)
            if problem:  # before a destination goes out: nothing is written here
                self.kv_mgr.fail(self.bootstrap_room, problem)
                self.conclude_state = sgl.KVPoll.Failed

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      *args, **kwargs) -> None:
        self.kv_mgr.expect(self.bootstrap_room, [] if kv_indices is None else kv_indices, aux_index,
                           self.prefill_info.attn_tp_size, state_indices)
        self._kvops_expected = True
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)

    def _check_waiting_timeout(self):
        if getattr(self, "_kvops_expected", False):
            return None  # the connector's lease and max wait bound it
        return super()._check_waiting_timeout()

    def abort(self) -> None:
        if not getattr(self, "_kvops_expected", False) or self.conclude_state is not None:
            super().abort()
            return
        self.ensure_abort_notified()  # the prefill stops pushing the room
        self.kv_mgr.give_up(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def _connect_to_bootstrap_server(self, bootstrap_info: dict):
        sock, lock = super()._connect_to_bootstrap_server(bootstrap_info)
        return SignedAborts(sock, self.kv_mgr.signer, sgl.ABORT_TAG), lock


class KvopsKVBootstrapServer(sgl.CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged: prefill ranks register there, decode
    ranks look them up."""

"""LayerwiseConnector: push each layer's KV blocks to decode while later layers compute.

The public API over both roles. The send path is in ``producer.py`` and ``sender.py``
(with ``peer.py``), the receive path in ``consumer.py``; what both share (configuration,
outcome reporting, counters) in ``config.py`` and ``ledger.py``. See
docs/connector.md for threads and failure semantics.
"""
# house: long because the one public API of both roles, whose docstrings carry the contract; the work lives in producer.py, sender.py and consumer*.py
from __future__ import annotations

import logging
import uuid
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..plan import KVLayout, TransferRequest
from ..staging import uniform_block
from ..transports.base import Transport, TransportError
from ..control import derived_secret
from ..tls import TlsFiles
from .config import PROTOCOL_VERSION, ConnectorConfig
from .consumer import ConsumerSide
from .ledger import ConnectorStats, RequestLedger
from .producer import ProducerSide

log = logging.getLogger(__name__)


class LayerwiseConnector:
    """Layer-wise KV transfer between a producer (prefill) and consumers (decode).

    Producer: ``register_kv_caches`` -> ``add_peer(consumer.peer_info())`` -> per step
    ``start_step(requests)``, model forward calling ``save_kv_layer(i, cache_i)`` after
    each layer's KV write (or ``attach``), ``wait_for_save()``, ``get_finished()``.
    A request's source blocks must stay allocated until it is reported finished or
    failed. Consumer: ``register_kv_caches`` -> share ``peer_info()`` -> optionally
    ``expect(req_id)`` -> poll ``get_finished()``.
    """

    def __init__(self, role: str, transport: Transport, config: Optional[ConnectorConfig] = None,
                 *, control_host: Optional[str] = None, fleet_key: Optional[bytes] = None,
                 control_tls: Optional[TlsFiles] = None) -> None:
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
        self.role = role
        self.transport = transport
        self.config = config or ConnectorConfig()
        self.engine_id = uuid.uuid4().hex[:12]
        self._control_host = control_host or transport.address().rsplit(":", 1)[0]
        # With a fleet key, control secrets are derived (control.derived_secret), never sent.
        self._fleet_key = fleet_key
        self._control_tls = control_tls  # mutual TLS on the control channel
        self._caches: List[torch.Tensor] = []
        self._layout: Optional[KVLayout] = None
        self._registered: List[int] = []
        self._stats: Optional[ConnectorStats] = None
        self._ledger: Optional[RequestLedger] = None
        self._side: Union[ProducerSide, ConsumerSide, None] = None
        self._hooks: list = []
        self._device_staged = False
        self._closed = False

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor],
                           spaces: Optional[Sequence[int]] = None) -> None:
        """Register one cache tensor per layer (dim 0 = block) with the transport.
        ``spaces``: per layer, its block space, where layers' blocks are allocated
        apart (plan.KVLayout.of: requests then name global block ids)."""
        if self._layout is not None:
            raise RuntimeError("register_kv_caches was already called")
        devices = {c.device for c in kv_caches}
        if len(devices) != 1:
            raise ValueError(f"all KV caches must be on one device, got {sorted(map(str, devices))}")
        device = next(iter(devices))
        if self.config.integrity_mode != "off" and device.type != "cpu":
            raise ValueError(f"ConnectorConfig(integrity_check={self.config.integrity_check!r}) "
                             "needs host (CPU) KV caches; "
                             f"these are on {device}")
        caches = list(kv_caches)
        # CUDA caches go through pinned host staging: the transport never touches them.
        self._device_staged = device.type == "cuda" and not self.config.direct_device_reads
        if self._device_staged and uniform_block(caches) is None:
            raise ValueError("CUDA KV caches go through host staging, which needs one block "
                             "shape and dtype in every layer; set ConnectorConfig("
                             "direct_device_reads=True) only for a transport that reads "
                             "device memory without a host copy")
        if not self._device_staged and not self.transport.supports_device(device.type):
            raise ValueError(f"transport {self.transport.name!r} cannot move {device.type} memory "
                             "(for direct device reads install the CUDA build of Mooncake, "
                             "mooncake-transfer-engine)")
        layout = KVLayout.of(caches, spaces)
        if layout.spaced and self._device_staged:
            raise ValueError("block spaces need caches the transport reads directly (host caches, "
                             "or ConnectorConfig(direct_device_reads=True)): staging slots "
                             "are not built for them")
        self._caches = caches
        self._layout = layout
        self._stats = ConnectorStats(len(caches))
        self._ledger = RequestLedger(self._stats)
        if not self._device_staged:
            for layer in self._layout.layers:
                base, length = layer.span()
                # P's cache is only ever read by its own writes: never offered to peers
                self.transport.register(base, length, exposed=self.role == "consumer")
                self._registered.append(base)
        if self.role == "producer":
            self._side = ProducerSide(self.engine_id, self._caches, self._layout, self.transport,
                                      self.config, self._ledger, self._stats, self._can_stage(),
                                      fleet_key=self._fleet_key, tls=self._control_tls)
        else:
            self._side = ConsumerSide(self._caches, self.transport, self.config, self._ledger,
                                      self._stats, self._control_host, self._can_stage(),
                                      secret=(derived_secret(self._fleet_key, self.engine_id)
                                              if self._fleet_key is not None else None),
                                      tls=self._control_tls, layout=self._layout)
        log.info("%s %s registered %d KV layers", self.role, self.engine_id, len(self._caches))

    def _can_stage(self) -> bool:
        """Staging slots hold whole blocks of one shape and dtype. On the CPU it is an
        optimization for fragmented layers (threshold 0 turns it off); with CUDA caches
        it keeps the transport off device memory unless direct reads are allowed. (An
        NPU gather would need its own stream: NPU caches are moved directly.)"""
        if self._device_staged:
            return True  # uniform blocks: checked by register_kv_caches
        return (not self._layout.spaced and self._caches[0].device.type == "cpu" and self.config.staging_threshold_bytes > 0
                and uniform_block(self._caches) is not None)

    def peer_info(self) -> dict:
        """Consumer: JSON-serializable description (addresses, cache layout, and the
        secret a producer must prove it knows to use the control channel). Hand it to
        producers only over the engine's own trusted channel, and do not log it. With a
        fleet key there is no secret in it (producers derive it): ``"auth": "fleet"``."""
        self._require("consumer", registered=True)
        info = {"version": PROTOCOL_VERSION, "engine_id": self.engine_id,
                "transport": self.transport.name, "data_address": self.transport.address(),
                "device": self._caches[0].device.type,
                "control_address": self._side.control_address, "layout": self._layout.to_json()}
        if self._fleet_key is not None:
            info["auth"] = "fleet"
        else:
            info["secret"] = self._side.secret
        return info

    def block_id_base(self, layer: int) -> int:
        """The id requests name ``layer``'s block 0 by (0 without block spaces)."""
        self._require(self.role, registered=True)
        return self._layout.layers[layer].id_base

    def add_peer(self, info: dict) -> str:
        """Producer: validate a consumer's layout against ours, connect its control
        channel, and return its peer id (the same id again for a known live peer). A
        known peer that was given up on is connected again, once none of its requests
        is in flight (``RuntimeError`` until then)."""
        self._require("producer", registered=True)
        return self._side.add_peer(info)

    def release_peers(self, idle_s: float, keep: Optional[int] = None) -> List[str]:
        """Producer, between steps: let go of the peers failed or unused for ``idle_s``
        with nothing in flight (control channel, staging), so resources stay flat while
        consumers come and go; with ``keep``, also the least recently used ones beyond
        ``keep`` live peers (those with nothing in flight). Returns their ids at once:
        they are closed on a thread of the connector's (a staging buffer a timed-out
        write may still read is kept until it is not), never on the caller's.
        :meth:`add_peer` reconnects."""
        self._require("producer", registered=True)
        return self._side.release_peers(idle_s, keep)

    def wait_for_release(self, timeout: float) -> bool:
        """Producer: wait until the peers let go of are closed; True if none is left
        (measurements of resources, tests)."""
        self._require("producer", registered=True)
        return self._side.wait_released(timeout)

    def peer_failed(self, peer_id: str) -> Optional[str]:
        """Producer: why the peer was given up on (until :meth:`add_peer`), or None."""
        self._require("producer", registered=True)
        return self._side.peer_failed(peer_id)

    def attach(self, model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> list:
        """Call ``save_kv_layer(i, cache_i)`` after ``layers[i]``'s forward (forward
        hooks), for model code that should not be edited. Returns the hook handles."""
        self._require("producer", registered=True)
        if len(layers) != len(self._caches):
            raise ValueError(f"{len(layers)} layers given for {len(self._caches)} KV caches")
        for i, module in enumerate(layers):
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))
        return list(self._hooks)

    def _make_hook(self, layer: int):
        def hook(module, args, output):
            self.save_kv_layer(layer, self._caches[layer])
        return hook

    # ------------------------------------------------------------------ producer step

    def start_step(self, requests: Iterable[TransferRequest], partial: bool = False) -> Dict[str, str]:
        """Validate this step's requests and hand the plan to the sender. Requests to a
        peer already given up on fail at once.

        A bad request (block ids out of range, a destination block another request of
        the step names, an unknown peer) raises ``ValueError`` and nothing is sent; with
        ``partial=True`` it is refused alone instead: reported failed (its consumer is
        told, and it sends no later chunk, so no destination is left with holes) while
        the others go; so is a request whose id was already reported finished (ids are
        sent once). Returns the refused requests with the reason for each. A request
        id twice in the step, or in flight to another peer, always raises."""
        self._require("producer", registered=True)
        return self._side.start_step(requests, partial)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Model hook: call right after layer ``layer``'s KV write. Only issues two ops
        with constant arguments, so it traces into torch.compile(fullgraph=True) and is
        captured with the model in a CUDA graph."""
        self._side.save_kv_layer(layer, kv_cache)

    def wait_for_save(self, timeout: Optional[float] = None) -> None:
        """Block until every layer of the current step was sent or failed."""
        self._require("producer", registered=True)
        self._side.wait_for_save(timeout)

    def abort(self, req_id: str, reason: str = "aborted by the engine") -> bool:
        """Producer, between steps: report an in-flight request failed (its consumer is
        told at once) because its remaining chunks will never be sent, e.g. the engine
        dropped the request mid-prefill. Returns False if it was not in flight (never
        started, or its outcome is already decided: that outcome stands)."""
        self._require("producer", registered=True)
        return self._side.abort(req_id, reason)

    # ------------------------------------------------------------------ consumer

    def expect(self, req_id: str, lease_s: Optional[float] = None,
               blocks: Optional[Iterable[int]] = None) -> bool:
        """Consumer: start the lease of a request the engine waits for, so it is
        reported failed if its producer never delivers (even if it never started).
        ``blocks``: the destination blocks the engine gave it. A ``begin`` that names
        any other block for it is rejected before a byte is written and the request
        fails (counted as ``begin_blocks_refused``): a producer with a wrong plan, or a
        stale or misrouted destination, writes into no block of another request.
        True also when the request ended before this call (its producer was faster):
        the next :meth:`get_finished` reports it. False, and nothing started, if the id
        was refused, or reported by an earlier :meth:`get_finished` (an id used twice):
        nothing will be reported for it again, so do not wait for it."""
        self._require("consumer", registered=True)
        return self._side.expect(req_id, lease_s, blocks)

    def refuse(self, req_ids: Iterable[str]) -> None:
        """Consumer: the engine gave these up before they began: a ``begin`` for one is
        refused (nothing lands in blocks it reuses). Expected or begun ids: untouched."""
        self._require("consumer", registered=True)
        self._side.refuse(list(req_ids))

    def renew(self, req_id: str) -> bool:
        """Consumer: extend the lease of an expected request by ``lease_s`` (its
        producer said it lives and still owes the push), never past ``max_wait_s``
        after it was first expected. False if it is not in flight here."""
        self._require("consumer", registered=True)
        return self._side.renew(req_id)

    # ------------------------------------------------------------------ both roles

    def get_finished(self) -> Tuple[Set[str], Set[str]]:
        """(finished, failed) request ids since the last call; each id is reported once.
        Producer: finished means every byte was sent and acknowledged as landed, so the
        source blocks may be freed. Consumer: every layer of every chunk has landed."""
        if isinstance(self._side, ConsumerSide):
            self._side.check()
        if self._ledger is None:
            return set(), set()
        return self._ledger.drain()

    def wait_for_finished(self, timeout_s: float, while_idle: bool = False) -> bool:
        """Block up to ``timeout_s`` until :meth:`get_finished` has a request to report,
        while any is in flight (returns at once otherwise, unless ``while_idle``); True
        if one is. An engine with nothing to compute calls this instead of polling
        ``get_finished`` in a busy loop: it wakes when a transfer ends, not a poll
        later. A thread whose only job is to collect outcomes passes ``while_idle``:
        returning at once while nothing is in flight would make its loop spin."""
        if self._ledger is None or timeout_s <= 0:
            return False
        side = self._side
        if while_idle:
            return self._ledger.wait_for_news(timeout_s, lambda: True)
        if isinstance(side, ConsumerSide):
            return self._ledger.wait_for_news(timeout_s, lambda: side.in_flight > 0)
        return self._ledger.wait_for_news(timeout_s, lambda: bool(self._ledger.in_flight))

    def outcome(self, req_id: str) -> Optional[bool]:
        """True/False once decided (also while its report is held back), None while in
        flight or never sent; :meth:`get_finished` still reports it once."""
        with self._ledger.lock:
            return self._ledger.outcome_locked(req_id)

    def landed_chunks(self, req_id: str) -> List[List[int]]:
        """Consumer: of a request the last :meth:`get_finished` reported, the
        destination blocks of each chunk whose every layer landed, in order (a finished
        request: all of them, so the engine can check they cover what it expected; a
        failed one: those before the failure, empty if nothing is usable). A block cut
        by a chunk boundary is whole only once the next chunk landed. Of a failed
        request nothing is vouched for after an integrity failure or with the integrity
        check on (bytes count once verified, at the last chunk)."""
        self._require("consumer", registered=True)
        return self._ledger.landed_chunks(req_id)

    def last_step_trace(self) -> List[dict]:
        """Per layer of the last step, ``time.perf_counter()`` seconds (CLOCK_MONOTONIC):
        ``pushed``, when the model pushed the layer (eager: when it issued the push;
        CUDA-graph replay: when the stream reached it, i.e. the KV write had finished);
        ``taken``, when the sender took it off the ready queue (after the step's
        ``begin`` round trip); ``event_ready``, when the layer's event was complete;
        ``staged``, when its last staging slot was gathered (None on the direct path);
        ``landed``, when its writes returned, i.e. its bytes were in the peer's memory."""
        return self._side.last_step_trace() if isinstance(self._side, ProducerSide) else []

    def stats(self) -> dict:
        """Counters (bytes, layers, requests finished/failed, retries, errors, control
        messages refused) and per-layer mean wait-for-event and transfer times
        (producer); docs/connector.md lists them."""
        if self._stats is None:
            return {}
        out = self._stats.snapshot()
        out["role"] = self.role
        if isinstance(self._side, ConsumerSide):
            out.update(self._side.counters())
            out["fenced_now"] = self._side.fenced  # revoked requests whose blocks wait for the fence
        with self._ledger.lock:
            out["in_flight"] = len(self._ledger.in_flight)
            if isinstance(self._side, ConsumerSide):
                out["in_flight"] += self._side.in_flight
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop threads, report unfinished requests failed, unregister memory. Raises
        if a thread did not stop within ``timeout`` (after releasing everything else)."""
        if self._closed:
            return
        self._closed = True
        problems: List[str] = []
        try:
            for handle in self._hooks:
                handle.remove()
            if self._side is not None:
                problems += self._side.close(timeout)
        finally:
            if self._ledger is not None:
                self._ledger.release_delayed()
            # Every release is attempted even if one fails (e.g. a region still read by
            # a timed-out write); the failures are raised together below.
            for base in self._registered:
                try:
                    self.transport.unregister(base)
                except (TransportError, OSError) as exc:
                    problems.append(f"release failed: {exc}")
            self._registered.clear()
        if problems:
            raise RuntimeError("; ".join(problems))

    def __enter__(self) -> "LayerwiseConnector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _require(self, role: str, registered: bool = False) -> None:
        if self.role != role:
            raise RuntimeError(f"this call is for the {role} role; this connector is a {self.role}")
        if registered and self._layout is None:
            raise RuntimeError("call register_kv_caches first")
        if self._closed:
            raise RuntimeError("the connector is closed")

"""``KvopsKVManager``: one per SGLang scheduler process, both roles.

SGLang's common layer (``CommonKVManager``) keeps what every backend shares: the
bootstrap server registration, each rank's ZMQ socket, the decode -> prefill
destination messages, and the per-room status that SGLang's senders and receivers
poll. This manager moves the KV with this package's :class:`LayerwiseConnector` over
Mooncake (one protocol with the vLLM adapter: control channel, leases, the fence) and
sets a room's status only from the connector's outcomes:

- prefill: a room is Success when the connector reports every byte landed (its pages
  may be freed) and its metadata row went out, Failed when the connector reports it
  failed;
- decode: a room is Success when every byte landed and its metadata row (first token,
  room) arrived, Failed when the connector reports it failed, which it does only once
  no write of the prefill can land any more (the fence).

What runs where: the forward pushes each layer as it is written (:mod:`.layerwise`);
SGLang's scheduler thread calls ``add_transfer_request`` (queues); ``kvops-sglang-push``
sends metadata rows and pushes what the forward did not (:mod:`.push_queue`);
``kvops-sglang-recv`` reads this rank's ZMQ socket; ``kvops-sglang-connect`` (prefill)
connects decode ranks as they register (:mod:`.decode_peers`); ``kvops-sglang-outcome`` turns
connector outcomes into room statuses; ``kvops-sglang-owed`` (prefill) tells decode
ranks which rooms it still owes (:mod:`.owed_notices`). A room goes to each decode rank
as a transfer of its own (:mod:`.transfers`). Threads
are daemons, as SGLang's own backends' are: they live as long as the scheduler process
(the connect threads are a thread pool's: an exiting process waits for an attempt under
way, bounded by the control timeout and its retries).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Dict, List, Set

import numpy as np

from ...connector import LayerwiseConnector
from ...plan import TransferRequest
from ...transports import MooncakeTransport, TransportError
from . import internals as sgl
from .decode_peers import HELD, DecodePeers, room_endpoint
from .decode_rooms import DecodeRooms
from .heads import RankHeads, moved_by
from .layerwise import LayerwisePrefill
from .metrics import Counts
from .owed_notices import STILL_OWED, renew_owed_rooms, tell_owed_rooms
from .prefill_restarts import PrefillRestartWatch
from .push_queue import METADATA_ROW, PushQueue
from .serial_sends import SerialSends
from .settings import KvopsSglangSettings
from .signing import MessageSigner
from .support import check_supported
from .swa_pool import pool_buffers, window_ids_frame, window_pages, window_transfer
from .transfers import Destination, destination, pushed_bytes, room_of, room_parts, transfer_id

log = logging.getLogger(__name__)

REGISTRATION = b"None"  # first frame of a decode rank's registration (SGLang's convention)
# decode: the connector's counters of failed rooms -> SGLang's counters (metrics.py)
MIRRORED = {"integrity_failures": "kvops_sglang_integrity_failures",
            "begin_blocks_refused": "kvops_sglang_misaddressed_rooms"}


class KvopsKVManager(SerialSends, PrefillRestartWatch, sgl.CommonKVManager):
    """See the module docstring."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: bool = False) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.prefill = disaggregation_mode == sgl.DisaggregationMode.PREFILL
        sgl.check_attributes(self, sgl.PREFILL_MANAGER_ATTRIBUTES if self.prefill
                             else sgl.DECODE_MANAGER_ATTRIBUTES)
        self.settings = KvopsSglangSettings.from_env()
        check_supported(args, server_args, self.settings.mha_unit, is_mla_backend)
        self.settings.check_exposure(self.local_ip)
        fleet_key = self.settings.fleet_key()
        self.signer = MessageSigner(fleet_key)
        self.heads = None if is_mla_backend or self.settings.mha_unit == "page" else RankHeads(
            sgl.total_kv_heads(server_args), self.attn_tp_size, self.attn_tp_rank, args.page_size)
        pages, sliding = pool_buffers(args)  # sliding: a hybrid pool's (swa_pool.py)
        self.caches = (pages if self.heads is None else self.heads.unit_views(pages)) + sliding
        self.full_buffers = len(self.caches) - len(sliding)
        self.transport = MooncakeTransport(host=self.local_ip, protocol=self.settings.protocol,
                                           device_name=self.settings.device_name)
        try:
            self.conn = LayerwiseConnector("producer" if self.prefill else "consumer",
                                           self.transport, self.settings.connector_config(),
                                           fleet_key=fleet_key)
            self.conn.register_kv_caches(self.caches, [0] * self.full_buffers + [1] * len(sliding)
                                         if sliding else None)
        except BaseException:
            self.transport.close()
            raise
        self.window_base = self.conn.block_id_base(self.full_buffers) if sliding else 0
        self.counts = Counts("prefill" if self.prefill else "decode")
        self._lock = threading.Lock()
        self.step_lock = threading.Lock()  # one connector step at a time: forward or push thread
        self._handle_lock = threading.RLock()  # one message handled at a time (decode_peers.py)
        self.decode_peers = DecodePeers(self.conn, self._handle_lock, self._handle, self.fail,
                                        counts=self.counts, heads=self.heads) if self.prefill else None
        self._prefill_parts: Dict[int, Set[str]] = {}  # prefill: room -> its parts done
        self.pushes = PushQueue(self)
        self.layerwise = self.rooms = None
        if self.prefill:
            self.layerwise = LayerwisePrefill(self, args.page_size, self.full_buffers, is_mla_backend,
                                              self.settings.sliding_layers == "window", len(sliding))
            self.layerwise.install()
        else:
            self.rooms = DecodeRooms(args, self._decode_success, self.fail)
        threads = [("recv", self._recv_loop), ("outcome", self._outcome_loop)]
        if self.prefill:
            threads += [("push", self.pushes.work), ("owed", lambda: tell_owed_rooms(self))]
        for name, target in threads:
            threading.Thread(target=target, name=f"kvops-sglang-{name}", daemon=True).start()
        if not self.prefill:
            # SGLang's heartbeat to the prefill servers' bootstrap (as its own backends
            # run it): one that stops answering loses its cached connection details, so
            # a restarted prefill server is looked up afresh (_handle_node_failure)
            self._start_heartbeat_checker_thread()
        log.info("kvops %s rank %s: %d KV buffers of %d pages, moved by %s", "prefill" if self.prefill
                 else "decode", self.kv_args.engine_rank, len(pages), pages[0].size(0), moved_by(self.heads))
        if sliding:
            log.info("kvops: a hybrid pool's %d sliding buffers of %d pages, ids from %d", len(sliding),
                     sliding[0].size(0), self.window_base)

    # ------------------------------------------------------------- decode -> prefill

    def build_receiver_registration_message(self) -> List[bytes]:
        info = dict(self.conn.peer_info(), sglang_windows_only=sgl.decode_reads_windows_only(self.server_args),
                    sglang_heads=None if self.heads is None else
                    {"total": self.heads.total, "tp_size": self.heads.tp_size, "rank": self.heads.rank})
        return self.signer.sign([REGISTRATION, self.local_ip.encode(), str(self.rank_port).encode(),
                                 info["engine_id"].encode(), json.dumps(info).encode()])

    def build_receiver_metadata_message(self, *, bootstrap_room, required_dst_info_num, kv_indices,
                                        aux_index, state_indices, decode_prefix_len, is_dummy,
                                        device_kv_indices=None) -> List[bytes]:
        pages = b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes()
        return self.signer.sign([
            str(bootstrap_room).encode(), self.local_ip.encode(), str(self.rank_port).encode(),
            self.conn.engine_id.encode(), pages,
            str(-1 if is_dummy or aux_index is None else aux_index).encode(),
            str(required_dst_info_num).encode(), str(decode_prefix_len or 0).encode(),
            window_ids_frame(None if is_dummy else window_pages(self.kv_args, state_indices, self.window_base))])

    def send_to_decode(self, endpoint: str, frames: List[bytes]) -> None:
        """Prefill: one of the backend's messages to a decode rank, signed."""
        self._send_multipart_locked(endpoint, self.signer.sign(frames))

    def _recv_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while True:
            msg = recv()
            if msg is None:
                continue
            try:  # SGLang's abort notice too (conn.SignedAborts)
                msg = self.signer.open(msg)
            except ValueError as exc:
                self.counts.add("kvops_sglang_refused_messages")
                log.warning("kvops: a message of %d frames was refused: %s", len(msg), exc)
                continue
            with self._handle_lock:
                self._handle(msg)

    def _handle(self, msg: List[bytes]) -> None:
        """One message, under ``_handle_lock``: on the receive thread, or on a connect
        thread for a room held while its decode rank connected."""
        try:
            if self.prefill:
                self._on_prefill_message(msg)
            else:
                self._on_decode_message(msg)
        except (ValueError, KeyError, IndexError, UnicodeDecodeError, TransportError,
                RuntimeError, OSError) as exc:
            # a peer's garbage fails that peer's rooms at most, never this thread
            log.warning("kvops: a message of %d frames was refused: %s", len(msg), exc)

    def _on_prefill_message(self, msg: List[bytes]) -> None:
        if msg[0] == sgl.ABORT_TAG:
            notice = sgl.AbortNotification.from_zmq(msg)
            if notice is not None:
                self.counts.add("kvops_sglang_abort_notices")
                self.pushes.abort(notice.room, "the decode side aborted it")
            return
        if msg[0] == REGISTRATION:
            info = json.loads(msg[4])
            if not isinstance(info, dict):
                raise ValueError("a registration whose peer_info is not an object")
            self.decode_peers.register(msg[3].decode(), info)  # connected off this thread
            return
        room, session = int(msg[0]), msg[3].decode()
        endpoint = room_endpoint(msg)
        required, prefix = int(msg[6]), int(msg[7])
        try:
            peer = self.decode_peers.peer(session, msg) if msg[4] else None
        except RuntimeError as exc:  # too many of its rooms wait for its link already
            self.fail(room, str(exc))
            return
        if peer == HELD:
            return  # handled again once its decode rank's link is made
        infos = self.transfer_infos.setdefault(room, {})
        if msg[4]:  # a dummy rank (no pages) gets nothing
            if peer is None:
                self.record_failure(room, f"decode rank {session} never registered")
                self.update_status(room, sgl.KVPoll.Failed)
                return
            try:
                theirs = self.decode_peers.registration(session) or {}
                infos[session] = destination(self.heads, theirs.get("sglang_heads"), peer, endpoint,
                                             np.frombuffer(msg[4], dtype=np.int32), int(msg[5]), session,
                                             theirs.get("sglang_windows_only") is True,
                                             np.frombuffer(msg[8], dtype=np.int64) if len(msg) > 8 and msg[8]
                                             else None, range(self.full_buffers, len(self.caches)))
            except ValueError as exc:
                self.fail(room, str(exc))
                return
        else:
            infos[session] = None
        if len(infos) == required:
            self.req_to_decode_prefix_len[room] = prefix
            self.update_status(room, sgl.KVPoll.WaitingForInput)

    # ------------------------------------------------------------- prefill: pushes

    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                             aux_index=None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None) -> None:
        """SGLang's scheduler, after a chunk's forward: queue its pages for the push
        thread (host caches: the forward's writes are done when this is called)."""
        if self.check_status(bootstrap_room) == sgl.KVPoll.Failed:
            return
        pages, index_slice = self.layerwise.hand_off(bootstrap_room, np.asarray(kv_indices, dtype=np.int64),
                                                     index_slice)
        last = bool(is_last_chunk)
        self.pushes.push(bootstrap_room, pages, index_slice, last, aux_index,
                         last and self.layerwise.pushed_last(bootstrap_room),
                         window_pages(self.kv_args, state_indices, self.window_base) if last else None)

    def ready_destinations(self, room: int) -> List[Destination]:
        """A room's destinations once all arrived."""
        if self.request_status.get(room) != sgl.KVPoll.WaitingForInput:
            return []
        return self.destinations(room)

    def destinations(self, room: int) -> List[Destination]:
        return [d for d in (self.transfer_infos.get(room) or {}).values() if d]

    def start_step(self, requests: List[TransferRequest]) -> bool:
        """Under ``step_lock``: end the previous step, start this one (a refused
        request is reported failed by the connector). False, and its rooms failed, if
        it could not start."""
        try:
            self.conn.wait_for_save(self.conn.config.step_timeout_s)
            if self.layerwise is not None:
                self.layerwise.count_overlap()  # the step just ended, if a forward's
            if self.decode_peers is not None:
                self.decode_peers.release_dead()  # between two steps
            self.conn.start_step(requests, partial=True)
            self.counts.add("kvops_sglang_pushed_bytes", pushed_bytes(requests, self.caches))
            return True
        except (ValueError, RuntimeError, TimeoutError) as exc:
            for room in {room_of(r.req_id) for r in requests}:
                self.fail(room, f"kvops push not started: {exc}")
            return False

    def save_buffer(self, index: int) -> None:
        self.conn.save_kv_layer(index, self.caches[index])

    def abort_room(self, room: int, reason: str) -> None:
        self.pushes.abort(room, reason)

    # ------------------------------------------------------------- decode side

    def expect(self, room: int, pages, aux_index: int, prefill_tp: int, state_indices=None) -> None:
        """Decode: the engine gave the room ``pages`` and a metadata row (before the
        destination message goes out). The prefill may write those pages only: whole
        (MLA, or MHA by page), or per prefill rank of attention TP ``prefill_tp`` that sends heads
        here, those heads of their tokens (MHA, :mod:`.heads`); and a hybrid pool's window
        pages (``state_indices``, swa_pool.py), as a transfer of its own."""
        parts = room_parts(self.heads, room, self.conn.engine_id, pages, prefill_tp)
        window = window_pages(self.kv_args, state_indices, self.window_base)
        if window is not None and len(window):
            parts[window_transfer(transfer_id(room, self.conn.engine_id))] = window.tolist()
        self.rooms.expect(room, aux_index, list(parts))
        for part, units in parts.items():
            if not self.conn.expect(part, blocks=units):
                self.fail(room, f"room {room} was already transferred here once (a room id is "
                                 "used once)")
                return

    def give_up(self, room: int) -> None:
        """Decode: the engine aborts the room. Its pages stay out of the engine's hands
        until the connector's outcome (the prefill is told through SGLang's abort
        message and stops)."""
        self.rooms.give_up(room)

    def forget(self, room: int) -> None:
        (self.layerwise or self.rooms).forget(room)
        with self._lock:
            self._prefill_parts.pop(room, None)

    def _on_decode_message(self, msg: List[bytes]) -> None:
        if msg[0] == STILL_OWED:
            renew_owed_rooms(self, msg[1])
            return
        if msg[0] != METADATA_ROW:
            raise ValueError(f"unexpected message {msg[0][:16]!r}")
        self.rooms.row_arrived(int(msg[1]), msg[2:])

    def _outcome_loop(self) -> None:
        counted = dict.fromkeys(MIRRORED, 0)  # the connector's counts, mirrored into SGLang's metrics
        while True:
            self.conn.wait_for_finished(0.5, while_idle=True)  # never a spinning loop
            finished, failed = self.conn.get_finished()
            if failed and not self.prefill:
                stats = self.conn.stats()
                for key, name in MIRRORED.items():
                    self.counts.add(name, stats[key] - counted[key])
                    counted[key] = stats[key]
            for transfer in finished:
                if self.prefill:
                    self.prefill_part_done(room_of(transfer), transfer)
                else:
                    self.rooms.part_ended(room_of(transfer), transfer)
            for transfer in failed:
                reason = "the kvops transfer failed (see the connector's log)"
                # decode: a room of several parts fails once none of them can write
                if self.prefill or not self.rooms.part_ended(room_of(transfer), transfer, reason):
                    self.fail(room_of(transfer), reason)

    def _decode_success(self, room: int) -> None:
        self.counts.add("kvops_sglang_rooms", 1, "success")
        self.update_status(room, sgl.KVPoll.Success)

    def prefill_part_done(self, room: int, part: str) -> None:
        """Prefill: a room is Success once its metadata row went out ("row") and its
        KV landed: each transfer to a decode rank (by its id), or "kv" where this rank
        has only dummy destinations. SGLang drops the room's destinations when it sees
        Success."""
        expected = {t for d in self.destinations(room) for t in d.transfers(room)} or {"kv"}
        with self._lock:
            parts = self._prefill_parts.setdefault(room, set())
            parts.add(part)
            complete = parts >= expected | {"row"}
            if complete:
                del self._prefill_parts[room]
        if complete:
            self.counts.add("kvops_sglang_rooms", 1, "success")
            self.update_status(room, sgl.KVPoll.Success)

    def fail(self, room: int, reason: str) -> None:
        self.counts.add("kvops_sglang_rooms", 1, "failed")
        self.record_failure(room, reason)
        self.update_status(room, sgl.KVPoll.Failed)


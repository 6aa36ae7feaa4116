"""The prefill side's ``kvops-sglang-push`` thread: what a forward did not push (a
chunk whose destination came after its forward began, a room's metadata row) and the
aborts of rooms, in the order SGLang's scheduler and the decode side queued them."""
from __future__ import annotations

import logging
import queue
from typing import TYPE_CHECKING, List, Optional, Set

import numpy as np
import zmq

from ...plan import TransferRequest
from .pages import read_rows

if TYPE_CHECKING:
    from .manager import KvopsKVManager

log = logging.getLogger(__name__)

METADATA_ROW = b"KVOPS_AUX"  # prefill -> decode: a room's metadata row


class PushQueue:
    """Items are ``("push", room, pages, index_slice, last, aux_index, last_pushed,
    window)`` or ``("abort", room, reason)``; everything queued when the thread wakes goes in
    one connector step (a room's next chunk in the step after)."""

    def __init__(self, manager: "KvopsKVManager") -> None:
        self.manager = manager
        self._items: "queue.Queue[tuple]" = queue.Queue()

    def push(self, room: int, pages: np.ndarray, index_slice: slice, last: bool, aux_index,
             last_pushed: bool, window: Optional[np.ndarray] = None) -> None:
        """Queue a chunk's pages (``last_pushed``: its forward pushed the last chunk's
        pages already; the metadata row still goes); with the last chunk, a hybrid
        pool's window pages (block ids, swa_pool.py)."""
        self._items.put(("push", room, pages, index_slice, last, aux_index, last_pushed, window))

    def abort(self, room: int, reason: str) -> None:
        self._items.put(("abort", room, reason))

    def work(self) -> None:
        """The thread's loop."""
        while True:
            batch = [self._items.get()]
            while True:
                try:
                    batch.append(self._items.get_nowait())
                except queue.Empty:
                    break
            self._run(batch)

    def _run(self, batch: List[tuple]) -> None:
        m = self.manager
        requests: List[TransferRequest] = []
        windows: List[TransferRequest] = []  # a hybrid pool's (swa_pool.py)
        rooms: Set[int] = set()
        for item in batch:
            if item[0] == "abort":
                self._abort(item[1], item[2])
                continue
            _, room, pages, index_slice, last, aux_index, last_pushed, window = item
            if room in rooms:  # a room's next chunk goes in the next step
                self._items.put(item)
                continue
            destinations = m.destinations(room)
            pushed = m.layerwise.pushed_window(room)
            if window is not None and pushed is not None:  # the forward pushed it
                if not np.array_equal(window, pushed):
                    m.fail(room, f"SGLang named window pages {window.tolist()[:4]}... of room {room}, "
                                 f"its forward pushed {pushed.tolist()[:4]}...")
                    continue
                window = None
            try:
                its_windows = [] if window is None else [
                    r for r in (d.window_request(room, window.tolist()) for d in destinations) if r]
            except ValueError as exc:
                m.fail(room, str(exc))
                continue
            try:
                if last and aux_index is not None:
                    rows = read_rows(m.kv_args.aux_data_ptrs, m.kv_args.aux_item_lens, aux_index)
                    for dest in destinations:
                        m.send_to_decode(dest.endpoint, [METADATA_ROW, str(room).encode(), *rows])
            except zmq.ZMQError as exc:
                m.fail(room, f"the metadata row did not reach the decode side: {exc}")
                continue
            if last:
                m.prefill_part_done(room, "row")
                if not destinations and m.transfer_infos.get(room):
                    # only dummy destinations: another prefill rank sends the room
                    # (MLA, fewer decode ranks), so this rank has nothing to move
                    m.prefill_part_done(room, "kv")
            if len(pages) or (last and not last_pushed):  # an empty last chunk still ends it
                requests += [dest.request(room, pages.tolist(), index_slice, last, m.layerwise.windows)
                             for dest in destinations]
            windows += its_windows
            rooms.add(room)
        if not requests and not windows:
            return
        with m.step_lock:
            if m.start_step(requests + windows):
                m.counts.add("kvops_sglang_chunks", len(requests), "after_forward")
                m.counts.add("kvops_sglang_chunks", len(windows), "window")
                for index in range(len(m.caches)):
                    m.save_buffer(index)

    def _abort(self, room: int, reason: str) -> None:
        """Fail a room the engine or the decode side dropped. The step a forward
        started may still be sending: the abort waits for its end."""
        m = self.manager
        with m.step_lock:
            try:
                m.conn.wait_for_save(m.conn.config.step_timeout_s)
            except TimeoutError:
                log.warning("kvops: room %d's abort waits for a step still sending", room)
                self._items.put(("abort", room, reason))
                return
            except RuntimeError as exc:  # the sender failed: it reads no page any more
                log.error("kvops: room %d aborted with the sender down: %s", room, exc)
                in_flight = False
            else:  # each of its transfers (one per decode rank it goes to)
                in_flight = any([m.conn.abort(transfer, reason) for dest in m.destinations(room)
                                 for transfer in dest.transfers(room)])
        if not in_flight:  # nothing can read its pages
            m.fail(room, reason)

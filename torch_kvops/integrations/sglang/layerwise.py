"""Layer-wise push on SGLang's prefill side: each layer's pages leave for the decode
side as soon as that layer's KV is written in the forward, while later layers compute.

SGLang starts a request's prefill only once its decode side posted the destination
(the bootstrap queue waits for it), so every chunk's destination is known when its
forward begins. Three hooks (installed by :mod:`.backend` in every SGLang process; they
do nothing where no ``kvops`` prefill manager runs):

- after ``PrefillBootstrapQueue.add``: the request's room is tracked by its id;
- around ``ModelRunner.forward``: the chunk of every tracked request in the batch is
  planned (the pages SGLang's ``send_kv_chunk`` will name for it: whole pages, and the
  partial last page only with the last chunk) and one connector step starts;
- after ``MHATokenToKVPool.set_kv_buffer`` (MLA: ``MLATokenToKVPool.set_kv_buffer``
  or ``set_mla_kv_buffer``): that layer's buffers are pushed, K and V (MLA: its one
  latent buffer) (``save_kv_layer``: on CPU the write is done; on a device it records
  the layer's event on the compute stream, never a stream sync).

SGLang's ``send()`` for a chunk pushed this way then only sends the metadata row (last
chunk); a chunk the forward did not push (its destination came later, or SGLang sent a
prefix it holds cached before the forward) is pushed then by the manager's push thread,
and so is the rest of its room, so a room's chunks leave in order. Pages the decode
side holds already (its radix cache) are never pushed: a room's pages are counted past
them, as SGLang's ``send()`` counts them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ...plan import TransferRequest
from .windows import SlidingWindows

if TYPE_CHECKING:
    from .manager import KvopsKVManager

log = logging.getLogger(__name__)

_PREFILL: Optional["LayerwisePrefill"] = None  # this process's, if it runs a kvops prefill


@dataclass
class _Room:
    rid: str
    room: int
    prompt_len: int
    pushed_tokens: int = 0  # tokens of the prompt whose pages were pushed in a forward
    pushed_pages: int = 0  # pages pushed in forwards, counted as SGLang's send() counts them
    pushed_last: bool = False  # a forward pushed its last chunk
    decode_prefix: int = 0  # tokens the decode side holds already (its radix cache): never sent
    handed_off: bool = False  # the push thread has a chunk of it: forwards push no more of it
    pushed_window: Optional[np.ndarray] = None  # a hybrid pool's window, pushed in the last forward


class LayerwisePrefill:
    """The prefill manager's layer-wise part (one per scheduler process)."""

    def __init__(self, manager: "KvopsKVManager", page_size: int, num_buffers: int,
                 latent: bool = False, windows: bool = True, sliding_buffers: int = 0) -> None:
        """``num_buffers``: SGLang's KV buffers, every layer's K then every layer's V,
        or with ``latent`` (MLA) one buffer per layer. ``windows``: in the one pool,
        push a sliding layer's pages of its window only (windows.py).
        ``sliding_buffers``: a hybrid pool's sliding layers' K then V (swa_pool.py),
        the connector's buffers after the KV buffers; a room's window goes in its
        last chunk's forward."""
        self.manager, self.page_size, self.num_buffers = manager, page_size, num_buffers
        self.num_layers = num_buffers if latent else num_buffers // 2
        self.sliding_buffers = sliding_buffers
        self._sliding_pool = None  # the hybrid pool's sliding part, read at the first forward
        self._window_slots = None  # its translation of full-pool slots to its own
        self._window_size = 0
        self._model_read = False
        self._rooms: Dict[str, _Room] = {}  # by SGLang request id
        self._by_room: Dict[int, _Room] = {}  # the same, by room
        self._lock = threading.Lock()
        self._saved: Optional[Set[int]] = None  # layers saved in the running forward's step
        self.windows: Optional[SlidingWindows] = None  # read from the model at its first forward
        self._windows_wanted = windows
        self._last_forward_end: Optional[float] = None  # of the last forward that pushed

    def install(self) -> None:
        global _PREFILL
        _PREFILL = self

    # ------------------------------------------------------------- bookkeeping

    def track(self, rid: str, room: int, prompt_len: int) -> None:
        with self._lock:
            self._rooms[rid] = self._by_room[room] = _Room(rid, room, prompt_len)

    def skip_decode_prefix(self, room: int, tokens: int) -> None:
        """The decode side holds the room's first ``tokens`` already (SGLang's decode
        radix cache): its destination names pages for the rest only, and SGLang's
        ``send()`` counts pages from there, so the forward's pushes do too."""
        with self._lock:
            tracked = self._by_room.get(room)
            if tracked is not None:
                tracked.decode_prefix = tokens
        self.manager.counts.add("kvops_sglang_decode_prefix_tokens", tokens)

    def hand_off(self, room: int, pages: np.ndarray, index_slice: slice) -> Tuple[np.ndarray, slice]:
        """SGLang's ``send()`` of the room's pages ``index_slice``: those the forwards
        did not push, for the push thread. Once it has some, the forwards push no more
        of the room, so its chunks leave in order: SGLang sends a prefix it holds
        cached before the forward that computes the rest (its early send), and a
        forward pushing the last chunk first would end the room before it."""
        with self._lock:
            tracked = self._by_room.get(room)
            if tracked is None:
                return pages, index_slice
            done = tracked.pushed_pages - index_slice.start
            if done > 0:  # the forward pushed these (or some)
                pages, index_slice = pages[done:], slice(index_slice.start + done, index_slice.stop)
            if len(pages):
                tracked.handed_off = True
        return pages, index_slice

    def pushed_window(self, room: int) -> Optional[np.ndarray]:
        """The hybrid pool's window a forward pushed of the room (block ids), if any."""
        with self._lock:
            tracked = self._by_room.get(room)
            return None if tracked is None else tracked.pushed_window

    def pushed_last(self, room: int) -> bool:
        with self._lock:
            tracked = self._by_room.get(room)
            return tracked is not None and tracked.pushed_last

    def forget(self, room: int) -> None:
        with self._lock:
            tracked = self._by_room.pop(room, None)
            if tracked is not None and self._rooms.get(tracked.rid) is tracked:
                del self._rooms[tracked.rid]

    # ------------------------------------------------------------- the forward

    def plan(self, forward_batch, req_to_token) -> List[TransferRequest]:
        """This forward's pushes: per tracked request with a known destination, the
        pages of its chunk as ``send_kv_chunk`` will cut them."""
        rids = forward_batch.rids or []
        prefixes, lengths = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        if not rids or prefixes is None or lengths is None:
            return []
        requests = []
        pool_rows = forward_batch.req_pool_indices.tolist()
        for rid, row, prefix, length in zip(rids, pool_rows, prefixes, lengths):
            with self._lock:
                tracked = self._rooms.get(rid)
            if tracked is None or tracked.handed_off:
                continue
            p, skipped = self.page_size, tracked.decode_prefix
            destinations = self.manager.ready_destinations(tracked.room)
            if not destinations or skipped % p:
                continue  # not ready (or an unaligned prefix): the push thread sends it
            end = int(prefix) + int(length)
            last = end >= tracked.prompt_len
            if not last:
                end -= end % p
            start = max(tracked.pushed_tokens, skipped)
            if end <= start:
                continue
            src = (req_to_token[row, start:end:p] // p).tolist()
            first, stop = (start - skipped) // p, -(-(end - skipped) // p)
            requests += [dest.request(tracked.room, src, slice(first, stop), last, self.windows)
                         for dest in destinations]
            window = self._window(req_to_token, row, skipped, end) if last else None
            if window is not None:  # a hybrid pool's (swa_pool.py)
                requests += [r for r in (d.window_request(tracked.room, window.tolist())
                                         for d in destinations) if r]
            with self._lock:
                tracked.pushed_tokens = end
                tracked.pushed_pages = stop
                if last:
                    tracked.pushed_last = True
                    tracked.pushed_window = window
        return requests

    def _window(self, req_to_token, row: int, prefix: int, end: int) -> Optional[np.ndarray]:
        """A room's window in the hybrid pool (block ids), as SGLang's prefill names it
        after the last chunk's forward (``_swa_payload``): the pages of the tokens from
        ``max(decode prefix, prompt - window)``, page-aligned, to the prompt's end."""
        if self._window_slots is None:
            return None
        p = self.page_size
        start = max(prefix, end - self._window_size)
        start -= start % p
        slots = self._window_slots(req_to_token[row, start:end])
        return (slots[::p] // p).to(torch.int64).numpy() + self.manager.window_base

    def _read_model(self, runner) -> None:
        """At the first forward: a hybrid pool's parts, or the sliding layers' windows
        in the one pool (where their pages are pushed from the window on)."""
        from . import internals as sgl  # (this module imports without SGLang: its units)

        self._model_read = True
        if self.sliding_buffers:
            self._sliding_pool, self._window_slots, self._window_size = sgl.hybrid_pool(runner)
        elif self._windows_wanted:
            self.windows = SlidingWindows.of_layers(
                sgl.sliding_windows(runner.model), getattr(runner.token_to_kv_pool, "start_layer", 0),
                self.num_layers, self.num_buffers, self.page_size,
                lambda pages: self.manager.counts.add("kvops_sglang_window_pages_skipped", pages))

    def forward(self, original, runner, forward_batch, *args, **kwargs):
        """Around ``ModelRunner.forward``: one connector step for the batch's chunks."""
        if not forward_batch.forward_mode.is_extend():
            return original(runner, forward_batch, *args, **kwargs)
        if not self._model_read:  # SGLang's warm-up forward comes before any room
            self._read_model(runner)
        try:
            requests = self.plan(forward_batch, runner.req_to_token_pool.req_to_token)
        except (KeyError, IndexError, ValueError, AttributeError):
            # SGLang's batch is not what was read: its chunks go after the forward
            log.exception("kvops: no layer-wise push for this forward")
            requests = []
        if not requests:
            return original(runner, forward_batch, *args, **kwargs)
        with self.manager.step_lock:
            if not self.manager.start_step(requests):  # its rooms are failed
                return original(runner, forward_batch, *args, **kwargs)
            self.manager.counts.add("kvops_sglang_chunks", len(requests), "forward")
            self._saved = set()
            try:
                return original(runner, forward_batch, *args, **kwargs)
            finally:
                # a layer the forward did not write (it raised) still ends the step
                for buffer in range(self.num_buffers + self.sliding_buffers):
                    if buffer not in self._saved:
                        self.manager.save_buffer(buffer)
                self._saved = None
                self._last_forward_end = time.perf_counter()

    def count_overlap(self) -> None:
        """Under ``step_lock``, once the last step ended: if a forward ran it, count its
        layers whose bytes landed before that forward ended (perf_counter clocks)."""
        end, self._last_forward_end = self._last_forward_end, None
        if end is None:
            return
        trace = self.manager.conn.last_step_trace()
        landed = [t.get("landed") for t in trace]
        self.manager.counts.add("kvops_sglang_layers", len([t for t in landed if t is not None]))
        self.manager.counts.add("kvops_sglang_layers_landed_during_forward",
                                len([t for t in landed if t is not None and t < end]))

    def layer_written(self, layer_id: int, pool=None) -> None:
        """After ``set_kv_buffer`` of ``pool``: push this layer's buffers (K and V, or
        its latent); ``layer_id`` is the pool's own (a hybrid pool's two parts each
        count their layers from 0)."""
        saved = self._saved
        if saved is None:
            return  # no push in this forward (or another thread's call)
        if pool is not None and pool is self._sliding_pool:
            layers = self.sliding_buffers // 2
            buffers = [self.num_buffers + layer_id, self.num_buffers + layers + layer_id]
        else:
            buffers = range(layer_id, self.num_buffers, self.num_layers)
        for buffer in buffers:
            if buffer not in saved:
                saved.add(buffer)
                self.manager.save_buffer(buffer)


# ----------------------------------------------------------------- the hooks


def after_bootstrap_add(result, queue, req, *args, **kwargs):
    """After ``PrefillBootstrapQueue.add``: track the request's room by its id."""
    # only kvops senders (warmup requests get SGLang's fake one, with room 0)
    if _PREFILL is not None and getattr(getattr(req, "disagg_kv_sender", None), "kvops", False):
        _PREFILL.track(req.rid, int(req.bootstrap_room), len(req.origin_input_ids))
    return result


def around_forward(original, runner, forward_batch, *args, **kwargs):
    if _PREFILL is None:
        return original(runner, forward_batch, *args, **kwargs)
    return _PREFILL.forward(original, runner, forward_batch, *args, **kwargs)


def after_set_kv_buffer(result, pool, layer, *args, **kwargs):
    if _PREFILL is not None:
        layer_id = kwargs.get("layer_id_override")
        _PREFILL.layer_written((layer.layer_id if layer_id is None else layer_id)
                               - getattr(pool, "start_layer", 0), pool)
    return result

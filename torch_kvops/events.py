"""LayerEvents: per-layer completion events and the ready queue the sender reads."""
from __future__ import annotations

import weakref
from typing import Optional, Union

import torch

from ._C import (layer_events_bind, layer_events_close, layer_events_create,
                 layer_events_next_ready, layer_events_pushed_at, layer_events_wait)


def _seconds(timeout: Optional[float]) -> Optional[float]:
    """None waits forever; huge values too (a C++ clock would overflow); negatives are 0."""
    if timeout is None or timeout > 1e9:
        return None
    return max(0.0, float(timeout))


class LayerEvents:
    """One completion event per layer on ``device`` plus a host-side ready queue.

    Model code calls ``record_layer_event(kv_cache, events.handle, i)`` and
    ``push_layer(kv_cache, events.handle, i)`` after writing layer ``i``'s KV cache;
    a sender thread calls :meth:`next_ready` then :meth:`wait` and moves the layer's
    blocks once the device has finished writing them. Waiting polls the layer's own
    event: it never synchronizes a stream or the device. Blocking calls release the
    GIL. ``handle`` is a plain ``int`` so it is a constant inside compiled graphs.
    """

    def __init__(self, num_layers: int, device: Union[str, torch.device] = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu" and self.device.index is None:
            backend = getattr(torch, self.device.type)  # torch.cuda, torch.npu (torch_npu)
            self.device = torch.device(self.device.type, backend.current_device())
        self.num_layers = int(num_layers)
        self.handle: int = layer_events_create(self.num_layers, str(self.device))
        # Runs once: on close(), on garbage collection, or at interpreter exit (while
        # the extension is still loaded), so no destructor has to guess.
        self._close = weakref.finalize(self, layer_events_close, self.handle)

    def bind(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Declare the tensor that holds ``layer``'s KV cache. The ops then reject any
        other tensor for that layer: inside a compiled graph that would be a temporary
        copy of the cache, written back only after the layer was already sent."""
        layer_events_bind(self.handle, layer, kv_cache)

    def next_ready(self, timeout: Optional[float] = None) -> Optional[int]:
        """Oldest pushed layer, or ``None`` if ``timeout`` seconds pass (or the pool is
        closed) first. ``timeout=None`` waits until a push or :meth:`close`."""
        return layer_events_next_ready(self.handle, _seconds(timeout))

    def wait(self, layer: int, timeout: Optional[float] = None) -> bool:
        """Block until the latest record of ``layer`` completed on the device. Returns
        ``False`` on timeout or close. Only meaningful for a layer whose record was
        issued for the current step: take layers from :meth:`next_ready`."""
        return layer_events_wait(self.handle, layer, _seconds(timeout))

    def pushed_at(self, layer: int) -> float:
        """``time.monotonic()`` seconds of the latest push of ``layer`` (0.0 if never):
        when the model issued it in eager mode; under CUDA-graph replay, when the stream
        reached the push, i.e. when the layer's KV write had finished on the device."""
        return layer_events_pushed_at(self.handle, layer)

    def close(self) -> None:
        """Wake every waiter, drop queued layers and free the handle. Idempotent."""
        self._close()

    def __enter__(self) -> "LayerEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LayerEvents(num_layers={self.num_layers}, device={self.device}, handle={self.handle})"

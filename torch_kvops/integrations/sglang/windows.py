"""Sliding-window layers (gpt-oss, Gemma, Mellum...) moved in SGLang's one KV pool
(``--disable-hybrid-swa-memory``): a sliding layer's pages before its window are never
read on the decode side, so P pushes only its window's pages of it.

A decode query at position ``q >= prompt_len`` reads a sliding layer's tokens from
``q - W`` on (``W``: the layer's ``sliding_window_size``, as SGLang's attention backends
mask it), so from ``prompt_len - W`` on; a token more is kept for a backend that counts
the window one token wider. A destination of ``n`` pages holds between ``(n - 1) * p + 1``
and ``n * p`` of the prompt's tokens past D's prefix, so the window starts no earlier
than page ``n - 1 - ceil(W / p)`` of it: P pushes the layer's pages from there (up to one
page more than needed), the full layers' pages all.

Only to a D that reads nothing else: not one that caches prompts (its radix cache: a
later prompt that shares this one's start reads its sliding layers' pages before this
window), nor one whose attention backend ignores the window (``flex_attention``,
``wave``: they read every token). D tells P in its registration
(``sglang_windows_only``); to a D that does not say, P pushes every page. With
``mha_unit: "head"`` the same pages' units (their tokens' heads) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class SlidingWindows:
    """Prefill: the KV buffers of the model's sliding layers, each with its window."""

    page_size: int
    num_buffers: int
    windows: Dict[int, int]  # KV buffer -> its layer's sliding_window_size (tokens)
    count: Callable[[int], None] = lambda pages: None  # pages x buffers not pushed

    @staticmethod
    def of_layers(layer_windows: Dict[int, int], start_layer: int, num_layers: int, num_buffers: int,
                  page_size: int, count: Callable[[int], None]) -> Optional["SlidingWindows"]:
        """The sliding layers on this rank, from the model's ``sliding_window_size`` per
        global layer id (-1: full attention; ``start_layer``: this rank's first, with
        pipeline parallelism), None without any. ``num_buffers``: every layer's K then
        every layer's V, or one latent buffer per layer."""
        windows: Dict[int, int] = {}
        for layer_id, window in layer_windows.items():
            local = layer_id - start_layer
            if window > -1 and 0 <= local < num_layers:
                windows.update(dict.fromkeys(range(local, num_buffers, num_layers), window))
        return SlidingWindows(page_size, num_buffers, windows, count) if windows else None

    def cut(self, dest_pages: int, first: int, pages: int) -> Tuple[int, Dict[int, int]]:
        """For the ``pages`` pages from page ``first`` of a destination of
        ``dest_pages`` pages: (how many of them no layer moves, dropped from the
        request; per sliding buffer, the first of the rest it moves, where not 0)."""
        firsts = {}
        for buffer, window in self.windows.items():
            start = max(0, dest_pages - 1 - -(-window // self.page_size))
            skipped = min(max(start - first, 0), pages)
            if skipped:
                firsts[buffer] = skipped
        dropped = min(firsts.values()) if len(firsts) == self.num_buffers else 0
        self.count(dropped * self.num_buffers + sum(f - dropped for f in firsts.values()))
        return dropped, {b: f - dropped for b, f in firsts.items() if f > dropped}

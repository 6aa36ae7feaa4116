"""A small Llama-style decoder with a paged KV cache, for demos, tests and benchmarks.

Pure PyTorch, random weights from ``LlamaConfig.seed``; nothing is downloaded. The
model has RMSNorm, rotary embeddings (rotate-half form), grouped-query attention, a
SwiGLU MLP and a tied or untied LM head.

KV cache layout
---------------
One tensor per layer, ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (contiguous):
dim 0 is the block, so block ``b`` is one contiguous range of ``2*block_size*kv_heads*
head_dim`` elements; ``[b, 0]`` holds K and ``[b, 1]`` holds V. A token's *slot* is
``block_id * block_size + offset``; the token at position ``p`` of a request lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``.

One forward step (:class:`PagedBatch` describes it) runs, per layer: QKV projection and
rotary embedding of the step's new tokens, ONE in-place ``index_put_`` of their K and V
into the layer's cache tensor, then ``self.kv_hook(layer_idx, kv_cache)`` (if set),
then, per request, causal attention of its new tokens over its whole context gathered
through its block table. Prefill, chunked prefill (a later chunk attends to KV written
by earlier steps) and decode (1 new token) are the same code.

Determinism / disaggregation
----------------------------
With ``LlamaConfig.batch_invariant=True`` (the default) every request of a step is run
through its own tensors (per-request matmuls, never a slice of a shared batch), so a
request's float ops depend only on its own tokens, its positions and its context values,
not on which other requests share the step or on its block ids. Hence prefill on one
process, copying the prompt's KV blocks into other block ids of another cache, then
:func:`decode_from_cache` gives bit-identical tokens to :func:`generate` in one process
(eager mode, same machine, same thread count, same chunking of the prefill). With
``batch_invariant=False`` the projections/MLP are batched over all tokens of the step
(faster for many concurrent decodes), and identical tokens additionally need the same
decode batch composition and order on both sides.

Timings (2-core Xeon dev box, torch 2.13.0+cpu, fp32, eager, one request, one-shot
prefill, best of 2-4; ``python -m torch_kvops.testing.paged_llama [--layers N --hidden H
--lengths ...]`` prints them for any shape):

=========================================  ========  ========  ========  ========
``LlamaConfig()`` = ``bench_config()``      1024 tok  2048 tok  3072 tok  4096 tok
(8 layers x 512, 24.7M params)
=========================================  ========  ========  ========  ========
2 threads, box (nearly) idle                0.29 s    0.66 s    1.9 s     1.9-2.4 s
2 threads, box busy with other processes    1.0 s     2.0 s     3.4 s     5.4 s
1 thread,  box busy with other processes    0.56 s    1.33 s    2.2 s     3.8 s
=========================================  ========  ========  ========  ========

A decode step (1 request, ~2k context) takes ~25-45 ms. Prefill cost is ~half matmuls,
~half attention at 4k tokens; time is ~linear in ``num_layers`` (``bench_config(4)``
takes about half, ``bench_config(16)`` about twice the 8-layer numbers). The box is
shared, so expect noise; on a loaded 2-core box small models run much faster with
``torch.set_num_threads(1)`` (the tests do that: ~30x for the tiny config).

Compiling: ``torch.compile(model, fullgraph=True)`` works (the hook is inlined). A
step's Python ints (tokens per request, context lengths) are specialised on the first
call; dynamo's automatic dynamic shapes then recompile once or twice and settle, and
each distinct *number of requests* in a step is its own graph. Inductor compiles take
~10-30 s each for the tiny test config on this box.

For a layer-wise KV connector
-----------------------------
``model.kv_hook = connector.method`` with ``method(layer_idx, kv_cache)``. ``kv_cache``
is ``kv_caches[layer_idx]`` itself (the tensor passed in, never a view or copy, also in
a compiled graph where the write is reinplaced: tested with ``LayerEvents.bind``); when
the hook runs, the step's new K/V of that layer are in it at ``batch.slot_mapping``
(block ``slot // block_size``, offset ``slot % block_size``), and nothing later in the
step writes that layer's cache again. The hook may be called inside a compiled graph,
so it must not read tensor values on the host or touch Python state per call beyond
what dynamo can trace; attributes read (e.g. ``self.handle``) are baked in as constants
and guarded. A hook that writes the cache itself (``kv_cache.add_``...) may make the
compiled graph work on a temporary copy: keep it to the kvops ops.
"""
from __future__ import annotations

from .batch import BlockAllocator, PagedBatch, blocks_needed, decode_batch, prefill_batch
from .config import LlamaConfig, bench_config, tiny_config
from .generation import decode_from_cache, generate, prefill
from .model import PagedLlama, reference_forward

__all__ = [
    "LlamaConfig",
    "PagedBatch",
    "PagedLlama",
    "BlockAllocator",
    "bench_config",
    "tiny_config",
    "blocks_needed",
    "prefill_batch",
    "decode_batch",
    "prefill",
    "generate",
    "decode_from_cache",
    "reference_forward",
]

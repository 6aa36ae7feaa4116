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

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

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


# --------------------------------------------------------------------------- config


@dataclass
class LlamaConfig:
    num_layers: int = 8
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 1408
    vocab_size: int = 2048
    block_size: int = 16
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Per-request matmuls: a request's results do not depend on the other requests
    # of the step (see the module docstring). False batches the projections/MLP.
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_cache_shape(self, num_blocks: int) -> tuple:
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self) -> int:
        """Bytes of one block of ONE layer's cache."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def tiny_config(**overrides) -> LlamaConfig:
    """A 2-layer, 64-wide model for fast unit tests."""
    kw = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
              intermediate_size=176, vocab_size=256, block_size=4)
    kw.update(overrides)
    return LlamaConfig(**kw)


def bench_config(num_layers: int = 8, hidden_size: int = 512, **overrides) -> LlamaConfig:
    """Benchmark preset: the default shape (prefill of 2k-4k tokens ~0.5-3 s on 2 CPU
    cores, see the module docstring) with ``num_layers`` / ``hidden_size`` scaled.
    Heads keep head_dim 64 and a 4:1 GQA ratio; intermediate ~ 2.75 x hidden (rounded
    to 16). Prefill time is ~linear in num_layers and ~quadratic in hidden_size."""
    num_heads = max(1, hidden_size // 64)
    kw = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
              num_kv_heads=max(1, num_heads // 4),
              intermediate_size=int(round(hidden_size * 2.75 / 16)) * 16)
    kw.update(overrides)
    return LlamaConfig(**kw)


# --------------------------------------------------------------------------- batch


def _as_index_tensor(x, device=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.to(dtype=torch.int64)
    else:
        t = torch.tensor(list(x), dtype=torch.int64)
    return t if device is None else t.to(device)


@dataclass
class PagedBatch:
    """One forward step over ``len(num_new_tokens)`` requests.

    - ``num_new_tokens[i]``: query tokens of request ``i`` in this step (Python int;
      the step's ``input_ids`` / ``positions`` are these runs concatenated in order).
    - ``context_lens[i]``: request ``i``'s total context after this step (Python int,
      >= num_new_tokens[i]); its new tokens sit at positions
      ``context_lens[i] - num_new_tokens[i] ... context_lens[i] - 1``.
    - ``block_tables[i]``: 1-D int64 tensor of block ids (lists are converted); at
      least ``ceil(context_lens[i] / block_size)`` entries, extra ones are ignored.
    - ``slot_mapping``: int64 ``[sum(num_new_tokens)]``, where each new token's K/V is
      written: ``block_id * block_size + offset``.
    """

    num_new_tokens: List[int]
    context_lens: List[int]
    block_tables: List[torch.Tensor]
    slot_mapping: torch.Tensor

    def __post_init__(self) -> None:
        self.num_new_tokens = [int(n) for n in self.num_new_tokens]
        self.context_lens = [int(n) for n in self.context_lens]
        self.block_tables = [_as_index_tensor(b) for b in self.block_tables]
        self.slot_mapping = _as_index_tensor(self.slot_mapping)
        if not (len(self.num_new_tokens) == len(self.context_lens) == len(self.block_tables)):
            raise ValueError("num_new_tokens, context_lens and block_tables differ in length")
        for n, c in zip(self.num_new_tokens, self.context_lens):
            if n < 1 or c < n:
                raise ValueError(f"bad request: num_new_tokens={n}, context_len={c}")
        if self.slot_mapping.shape != (self.num_tokens,):
            raise ValueError(f"slot_mapping shape {tuple(self.slot_mapping.shape)} != "
                             f"({self.num_tokens},)")

    @property
    def num_requests(self) -> int:
        return len(self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def to(self, device) -> "PagedBatch":
        return PagedBatch(self.num_new_tokens, self.context_lens,
                          [b.to(device) for b in self.block_tables],
                          self.slot_mapping.to(device))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _slots(block_table: Sequence[int], start: int, stop: int, block_size: int) -> List[int]:
    bt = list(block_table)
    if blocks_needed(stop, block_size) > len(bt):
        raise ValueError(f"block table of {len(bt)} blocks cannot hold {stop} tokens "
                         f"(block_size {block_size})")
    return [bt[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _table_list(bt) -> List[int]:
    return bt.tolist() if isinstance(bt, torch.Tensor) else [int(b) for b in bt]


def prefill_batch(prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]],
                  start_positions: Optional[Sequence[int]] = None, block_size: int = 16,
                  device="cpu"):
    """Build ``(input_ids, positions, batch)`` for one prefill step.

    ``prompts[i]`` are the tokens to process in this step for request ``i``; with
    ``start_positions`` (chunked prefill) they sit at positions ``start_positions[i] ...``,
    the earlier positions already being in the cache. ``block_tables[i]`` must cover
    ``start + len(prompts[i])`` tokens.
    """
    if start_positions is None:
        start_positions = [0] * len(prompts)
    ids, pos, slots, n_new, ctx = [], [], [], [], []
    for toks, bt, start in zip(prompts, block_tables, start_positions):
        toks = [int(t) for t in toks]
        stop = start + len(toks)
        ids += toks
        pos += range(start, stop)
        slots += _slots(_table_list(bt), start, stop, block_size)
        n_new.append(len(toks))
        ctx.append(stop)
    batch = PagedBatch(n_new, ctx, [_as_index_tensor(_table_list(b)) for b in block_tables],
                       torch.tensor(slots, dtype=torch.int64))
    return (torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device), batch.to(device))


def decode_batch(tokens: Sequence[int], context_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], block_size: int = 16, device="cpu"):
    """Build ``(input_ids, positions, batch)`` for one decode step: request ``i`` feeds
    ``tokens[i]`` at position ``context_lens[i] - 1`` (``context_lens`` counts the token
    fed now). ``block_tables[i]`` must cover ``context_lens[i]`` tokens."""
    slots = []
    for c, bt in zip(context_lens, block_tables):
        slots += _slots(_table_list(bt), c - 1, c, block_size)
    batch = PagedBatch([1] * len(tokens), list(context_lens),
                       [_as_index_tensor(_table_list(b)) for b in block_tables],
                       torch.tensor(slots, dtype=torch.int64))
    return (torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=device),
            torch.tensor([c - 1 for c in context_lens], dtype=torch.int64, device=device),
            batch.to(device))


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks-1``; allocates lowest ids first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = int(num_blocks)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() from the end
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: want {n}, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            b = int(b)
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)
        self._free.sort(reverse=True)


# --------------------------------------------------------------------------- model


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)


class PagedLlama(nn.Module):
    """Llama-style decoder over a paged KV cache; see the module docstring.

    ``kv_hook``: ``None`` or a callable ``(layer_idx: int, kv_cache: Tensor) -> None``
    called right after layer ``layer_idx``'s new K/V were written into ``kv_cache`` and
    before that layer's attention reads it. Under ``torch.compile(fullgraph=True)`` it
    is inlined, so it must only do traceable things (torch ops, custom ops with
    Python-int constants).
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.kv_hook: Optional[Callable[[int, torch.Tensor], None]] = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._init_weights()
        self.to(cfg.dtype)
        self.inv_freq = self.inv_freq.float()
        self.requires_grad_(False)
        self.eval()

    @torch.no_grad()
    def _init_weights(self) -> None:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def normal_(t: torch.Tensor, std: float) -> None:
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std)

        # Embedding rows ~ unit RMS (untied head). Input projections ~ 1/sqrt(fan_in) so their
        # outputs are ~unit scale after the pre-norm; residual branch outputs are scaled
        # by 1/sqrt(2*num_layers) so the residual stream grows slowly over the layers.
        # Norm weights get a little noise so they are not trivially all ones.
        # A tied head reads the embedding back: a unit-scale embedding would dominate
        # the residual stream and greedy decoding would echo the input token, so the
        # tied embedding is small (GPT-2 style) and the residual branches dominate.
        normal_(self.embed.weight, 1.0 if self.lm_head is not None else 0.02)
        res_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
        for layer in self.layers:
            normal_(layer.qkv_proj.weight, 1.0 / math.sqrt(cfg.hidden_size))
            normal_(layer.o_proj.weight, res_scale / math.sqrt(layer.q_size))
            normal_(layer.gate_up_proj.weight, 1.0 / math.sqrt(cfg.hidden_size))
            normal_(layer.down_proj.weight, res_scale / math.sqrt(cfg.intermediate_size))
            for norm in (layer.input_norm, layer.post_attn_norm):
                norm.weight.copy_(1.0 + 0.1 * torch.randn(norm.weight.shape, generator=g))
        self.norm.weight.copy_(1.0 + 0.1 * torch.randn(self.norm.weight.shape, generator=g))
        if self.lm_head is not None:
            # Logits with std ~3 so greedy picks are not near-ties.
            normal_(self.lm_head.weight, 3.0 / math.sqrt(cfg.hidden_size))

    # ---- helpers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def allocate_kv_caches(self, num_blocks: int, device="cpu") -> List[torch.Tensor]:
        """One zeroed tensor per layer, ``[num_blocks, 2, block_size, kv_heads, head_dim]``."""
        return [torch.zeros(self.cfg.kv_cache_shape(num_blocks), dtype=self.cfg.dtype,
                            device=device) for _ in range(self.cfg.num_layers)]

    def _rope(self, positions: torch.Tensor):
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dt = self.cfg.dtype
        return emb.cos().to(dt)[:, None, :], emb.sin().to(dt)[:, None, :]

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                n_new: int, ctx: int) -> torch.Tensor:
        """q: [n_new, H, D] -> [n_new, H*D]; causal over the request's ``ctx`` tokens."""
        cfg = self.cfg
        nb = (ctx + cfg.block_size - 1) // cfg.block_size
        kv = kv_cache[block_table[:nb]]                    # [nb, 2, bs, Hkv, D] (gather)
        k = kv[:, 0].reshape(nb * cfg.block_size, cfg.num_kv_heads, cfg.head_dim)[:ctx]
        v = kv[:, 1].reshape(nb * cfg.block_size, cfg.num_kv_heads, cfg.head_dim)[:ctx]
        # [1, heads, tokens, D]: the 4-D form takes the CPU flash kernel (3-D does not)
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if n_new == ctx:        # whole context is new: plain causal
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif n_new == 1:        # decode: the one query sees everything
            out = F.scaled_dot_product_attention(q, k, v)
        else:                   # chunk: query j (position ctx-n_new+j) sees keys <= it
            q_pos = torch.arange(n_new, device=q.device) + (ctx - n_new)
            visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~visible, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out[0]                                                     # [H, n, D]
        return out.transpose(0, 1).reshape(n_new, cfg.num_heads * cfg.head_dim)

    # ---- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], batch: PagedBatch) -> torch.Tensor:
        """Run one step; returns float logits ``[num_requests, vocab]`` of each request's
        last new token. Writes the step's K/V into ``kv_caches`` at ``batch.slot_mapping``."""
        cfg = self.cfg
        bs, H, Hkv, D = cfg.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n_new = batch.num_new_tokens
        n_req = len(n_new)

        # Token groups that share matmuls: one per request (batch invariant: a request
        # never shares a matmul with another, so its results do not depend on them) or
        # one for the whole step. group_reqs[g]: (request, first row in group g).
        if cfg.batch_invariant:
            bounds, start = [], 0
            for n in n_new:
                bounds.append((start, start + n))
                start += n
            group_reqs = [[(i, 0)] for i in range(n_req)]
        else:
            bounds = [(0, sum(n_new))]
            row, reqs = 0, []
            for i, n in enumerate(n_new):
                reqs.append((i, row))
                row += n
            group_reqs = [reqs]

        hs = [self.embed(input_ids[a:b]) for a, b in bounds]
        ropes = [self._rope(positions[a:b]) for a, b in bounds]

        # K/V write indices (block, 0=K/1=V, offset) into [num_blocks, 2, bs, Hkv, D];
        # the same for every layer. First the step's K rows, then its V rows.
        slots = batch.slot_mapping
        blk, off = slots // bs, slots % bs
        w_blk = torch.cat((blk, blk))
        w_kv = torch.cat((torch.zeros_like(blk), torch.ones_like(blk)))
        w_off = torch.cat((off, off))

        for layer_idx, layer in enumerate(self.layers):
            kv_cache = kv_caches[layer_idx]
            qs, ks, vs = [], [], []
            for h, (cos, sin) in zip(hs, ropes):
                n = h.shape[0]
                qkv = layer.qkv_proj(layer.input_norm(h))
                q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
                q = q.reshape(n, H, D)
                k = k.reshape(n, Hkv, D)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                qs.append(q)
                ks.append(k)
                vs.append(v.reshape(n, Hkv, D))
            # ONE in-place scatter of all new K and V of this layer, on the cache tensor
            # itself (not a view of it: under torch.compile a write through a view of a
            # graph input is functionalized into a temporary that is copied back only at
            # the end of the graph, so the hook would see a stale/temporary tensor).
            new_kv = torch.cat(ks + vs, dim=0)                   # [2*T, Hkv, D]
            kv_cache.index_put_((w_blk, w_kv, w_off), new_kv)
            if self.kv_hook is not None:
                self.kv_hook(layer_idx, kv_cache)

            new_hs = []
            for g, h in enumerate(hs):
                attn = [self._attend(qs[g][r0:r0 + n_new[i]], kv_cache, batch.block_tables[i],
                                     n_new[i], batch.context_lens[i])
                        for i, r0 in group_reqs[g]]
                attn = attn[0] if len(attn) == 1 else torch.cat(attn, dim=0)
                h = h + layer.o_proj(attn)
                gate, up = layer.gate_up_proj(layer.post_attn_norm(h)).chunk(2, dim=-1)
                h = h + layer.down_proj(F.silu(gate) * up)
                new_hs.append(h)
            hs = new_hs

        # last new token of each request
        if cfg.batch_invariant:
            logits = [self._logits(h[-1:]) for h in hs]
            return logits[0] if n_req == 1 else torch.cat(logits, dim=0)
        idx, row = [], -1
        for n in n_new:
            row += n
            idx.append(row)
        last = hs[0][torch.tensor(idx, device=hs[0].device)]
        return self._logits(last)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.lm_head_weight).float()


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def reference_forward(model: PagedLlama, tokens: Sequence[int]) -> torch.Tensor:
    """Plain (non-paged) forward of one sequence with dense causal attention and the
    same weights; returns float logits of EVERY position, ``[len(tokens), vocab]``."""
    cfg = model.cfg
    dev = model.embed.weight.device
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=dev)
    n = ids.shape[0]
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # rotary angles computed independently of PagedLlama._rope (float64): dims i and
    # i + D/2 rotate together by position * theta^(-2i/D)
    inv = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos = ang.cos().repeat(1, 2)[:, None, :].to(device=dev, dtype=cfg.dtype)
    sin = ang.sin().repeat(1, 2)[:, None, :].to(device=dev, dtype=cfg.dtype)
    h = model.embed(ids)
    for layer in model.layers:
        qkv = layer.qkv_proj(layer.input_norm(h))
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q = q.reshape(n, H, D)
        k = k.reshape(n, Hkv, D)
        v = v.reshape(n, Hkv, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        k = k.repeat_interleave(H // Hkv, dim=0)
        v = v.repeat_interleave(H // Hkv, dim=0)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v.float()).to(h.dtype)
        h = h + layer.o_proj(attn.transpose(0, 1).reshape(n, H * D))
        gate, up = layer.gate_up_proj(layer.post_attn_norm(h)).chunk(2, dim=-1)
        h = h + layer.down_proj(F.silu(gate) * up)
    return F.linear(model.norm(h), model.lm_head_weight).float()


# --------------------------------------------------------------------------- driving


def _ensure_blocks(block_table: List[int], num_tokens: int, block_size: int,
                   allocator: Optional[BlockAllocator]) -> None:
    need = blocks_needed(num_tokens, block_size) - len(block_table)
    if need > 0:
        if allocator is None:
            raise ValueError(f"block table of {len(block_table)} blocks cannot hold "
                             f"{num_tokens} tokens and no allocator was given")
        block_table.extend(allocator.allocate(need))


@torch.no_grad()
def prefill(model, prompts: Sequence[Sequence[int]], kv_caches: Sequence[torch.Tensor],
            block_tables: List[List[int]], chunk_size: Optional[int] = None,
            allocator: Optional[BlockAllocator] = None, forward=None) -> List[int]:
    """Prefill every prompt (all requests together in each step; with ``chunk_size``,
    step ``s`` feeds tokens ``s*chunk_size ...`` of each prompt still unfinished) and
    return each request's first generated token (argmax of its last prefill logits).

    ``block_tables[i]`` (a list, extended in place from ``allocator`` if short) must end
    up covering the prompt. ``forward`` defaults to ``model`` (pass a compiled one)."""
    cfg = _cfg(model)
    forward = model if forward is None else forward
    device = kv_caches[0].device
    for p, bt in zip(prompts, block_tables):
        _ensure_blocks(bt, len(p), cfg.block_size, allocator)
    first = [None] * len(prompts)
    longest = max(len(p) for p in prompts)
    step = longest if chunk_size is None else chunk_size
    for start in range(0, longest, step):
        live = [i for i, p in enumerate(prompts) if start < len(p)]
        ids, pos, batch = prefill_batch([prompts[i][start:start + step] for i in live],
                                        [block_tables[i] for i in live],
                                        [start] * len(live), cfg.block_size, device)
        logits = forward(ids, pos, kv_caches, batch)
        for row, i in enumerate(live):
            if start + step >= len(prompts[i]):
                first[i] = int(logits[row].argmax())
    return first


@torch.no_grad()
def decode_from_cache(model, prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                      block_tables: List[List[int]], kv_caches: Sequence[torch.Tensor],
                      max_new_tokens: int, allocator: Optional[BlockAllocator] = None,
                      forward=None) -> List[List[int]]:
    """The decode side of a disaggregated setup: the K/V of every prompt token is
    already in ``kv_caches`` (in this side's ``block_tables[i]``, positions
    ``0 .. len(prompts[i])-1``) and ``first_tokens[i]`` is the prefill side's argmax.
    Greedy-decodes the rest; returns ``max_new_tokens`` tokens per request, the first
    being ``first_tokens[i]`` (so equal to :func:`generate`'s output).

    Only ``len(prompts[i])`` is used from the prompts. Block tables are lists extended
    in place (from ``allocator``) to hold ``len(prompt) + max_new_tokens - 1`` tokens;
    without an allocator they must already be that long. The caller frees them.
    """
    cfg = _cfg(model)
    forward = model if forward is None else forward
    device = kv_caches[0].device
    out = [[int(t)] for t in first_tokens]
    lens = [len(p) for p in prompts]
    for step in range(max_new_tokens - 1):
        ctx = [n + step + 1 for n in lens]
        for c, bt in zip(ctx, block_tables):
            _ensure_blocks(bt, c, cfg.block_size, allocator)
        ids, pos, batch = decode_batch([o[-1] for o in out], ctx, block_tables,
                                       cfg.block_size, device)
        logits = forward(ids, pos, kv_caches, batch)
        nxt = logits.argmax(dim=-1).tolist()
        for o, t in zip(out, nxt):
            o.append(int(t))
    return out


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             kv_caches: Sequence[torch.Tensor], allocator: BlockAllocator,
             chunk_size: Optional[int] = None, forward=None,
             free_blocks: bool = True) -> List[List[int]]:
    """Monolithic greedy generation: :func:`prefill` (chunked if ``chunk_size``) then
    :func:`decode_from_cache` in the same cache. Returns ``max_new_tokens`` tokens per
    prompt. Blocks come from ``allocator`` and are freed at the end (``free_blocks``)."""
    block_tables: List[List[int]] = [[] for _ in prompts]
    try:
        first = prefill(model, prompts, kv_caches, block_tables, chunk_size, allocator,
                        forward)
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        return decode_from_cache(model, prompts, first, block_tables, kv_caches,
                                 max_new_tokens, allocator, forward)
    finally:
        if free_blocks:
            for bt in block_tables:
                allocator.free(bt)


def _cfg(model) -> LlamaConfig:
    m = getattr(model, "_orig_mod", model)
    return m.cfg


# --------------------------------------------------------------------------- timing


def _time_prefill(cfg: LlamaConfig, lengths=(1024, 2048, 4096), repeats: int = 2) -> None:
    import time

    model = PagedLlama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{cfg}\nparams: {n_params / 1e6:.1f}M, threads: {torch.get_num_threads()}")
    for n in lengths:
        caches = model.allocate_kv_caches(blocks_needed(n, cfg.block_size))
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        best = float("inf")
        for _ in range(repeats):
            bt = [list(range(blocks_needed(n, cfg.block_size)))]
            t0 = time.perf_counter()
            prefill(model, [prompt], caches, bt)
            best = min(best, time.perf_counter() - t0)
        print(f"prefill {n:5d} tokens: {best:.3f} s")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="time one-shot prefill of PagedLlama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    a = ap.parse_args()
    _time_prefill(bench_config(a.layers, a.hidden), a.lengths)

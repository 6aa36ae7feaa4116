"""PagedLlama: the decoder over a paged KV cache (the KV hook is called per layer), and
a dense, non-paged reference forward with the same weights to check it against."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .batch import PagedBatch
from .config import LlamaConfig

__all__ = ["DecoderLayer", "PagedLlama", "RMSNorm", "reference_forward"]


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
    """Llama-style decoder over a paged KV cache; see the package docstring.

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

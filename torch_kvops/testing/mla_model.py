"""A small DeepSeek-V2-style checkpoint (MLA attention, dense MLP; Hugging Face layout,
safetensors) whose output depends on its context, for engine-level tests of latent KV
caches.

It keeps what vLLM's CPU MLA backend needs (``kv_lora_rank`` 512 + ``qk_rope_head_dim``
64 = 576 values per token in the cache) and shrinks the rest: few layers, small hidden
size and vocabulary, and no mixture of experts (``first_k_dense_replace`` >= the layer
count makes every layer's MLP dense). As for the test Llama (hf_model.py), dummy
weights would make attention near-uniform, so a transfer that moves nothing would
still give the reference tokens: the query, latent and rope projections are drawn
large enough that softmax picks few positions, while values and outputs keep the
residual stream bounded. tests/test_vllm_mla.py asserts the context property with a
real engine.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .hf_model import write_checkpoint

KV_LORA_RANK = 512  # the latent: what CPU_MLA caches (with the rope part) per token
QK_ROPE_HEAD_DIM = 64
# Attention logits: the rope part has std ~ sqrt(64) * (16 * Q_STD) * (16 * KV_A_STD),
# the latent part ~ sqrt(nope) * (16 * Q_STD) * (sqrt(512) * KV_B_STD), both divided by
# sqrt(nope + 64): ~1.5 together at hidden 256, nope 32: a query weighs few tokens
# (checked: prompts sharing their last token answer differently), while the greedy
# choice stays clear of vLLM's CPU MLA rounding (LM_HEAD_GAIN: logits' std ~4).
Q_STD = 0.08
KV_A_STD = 0.08
KV_B_STD = 0.05
LM_HEAD_GAIN = 4.0


# SGLang's CPU rope for DeepSeek models takes only its yarn scaling; at factor 1 and
# mscale 1, yarn is the plain rope (same frequencies, no attention scaling), so the
# model computes what it computes without it
PLAIN_YARN = {"type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
              "mscale_all_dim": 1.0}


def mla_model_config(*, layers: int = 4, hidden: int = 256, heads: int = 4, qk_nope_head_dim: int = 32,
                     v_head_dim: int = 32, vocab: int = 1024, max_len: int = 4096,
                     rope_scaling: Optional[dict] = None) -> dict:
    """config.json of the test DeepSeek-V2-style model (MLA, no MoE layer);
    ``rope_scaling``: e.g. :data:`PLAIN_YARN` for SGLang on CPU."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": hidden, "intermediate_size": hidden * 2, "moe_intermediate_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None, "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim,
        # every layer dense (first_k_dense_replace >= num_hidden_layers): the expert
        # counts are set only because the config class requires integers; no expert exists
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": layers, "moe_layer_freq": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "scoring_func": "softmax",
        "vocab_size": vocab, "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "attention_bias": False,
        "rope_scaling": dict(rope_scaling, original_max_position_embeddings=max_len) if rope_scaling else None,
        "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu",
    }


def mla_model_weights(config: dict, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded weights for ``config`` under the names DeepseekV2ForCausalLM loads."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, nope, rope = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v_dim, rank = config["v_head_dim"], config["kv_lora_rank"]

    def normal(shape, std):
        return (torch.randn(shape, generator=gen) * std).contiguous()

    w = {"model.embed_tokens.weight": normal((config["vocab_size"], hidden), 1.0),
         "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": normal((config["vocab_size"], hidden), LM_HEAD_GAIN / math.sqrt(hidden))}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((heads * (nope + rope), hidden), Q_STD)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = normal((rank + rope, hidden), KV_A_STD)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(rank)
        # rows per head: nope key rows then value rows; the value rows carry the
        # attended tokens into the residual at full weight (latent rms ~1)
        kv_b = torch.cat([normal((heads, nope, rank), KV_B_STD),
                          normal((heads, v_dim, rank), 1.0 / math.sqrt(rank))], dim=1)
        w[p + "self_attn.kv_b_proj.weight"] = kv_b.reshape(heads * (nope + v_dim), rank).contiguous()
        w[p + "self_attn.o_proj.weight"] = normal((hidden, heads * v_dim), 1.0 / math.sqrt(heads * v_dim))
        w[p + "mlp.gate_proj.weight"] = normal((inter, hidden), 1.0 / math.sqrt(hidden))
        w[p + "mlp.up_proj.weight"] = normal((inter, hidden), 1.0 / math.sqrt(hidden))
        w[p + "mlp.down_proj.weight"] = normal((hidden, inter), 0.5 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return w


def write_mla_model(directory: str, *, seed: int = 0, **config_kwargs) -> dict:
    """Write config.json and model.safetensors of the test MLA model into ``directory``
    (keyword arguments as :func:`mla_model_config`); returns the config."""
    config = mla_model_config(**config_kwargs)
    return write_checkpoint(directory, config, mla_model_weights(config, seed))

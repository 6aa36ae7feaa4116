"""A small Llama checkpoint (Hugging Face layout, safetensors) whose output depends on
its context, for engine-level tests and examples.

vLLM's ``load_format="dummy"`` weights are uniform +-1e-3: attention is then
near-uniform and the next token depends on the last prompt token alone, so a KV
transfer that moves nothing still gives the reference tokens. These weights are drawn
from a seed with scales that make attention sharp (query/key projections large enough
that softmax picks few positions) while the residual stream stays bounded, so a
missing, misplaced or stale block changes the tokens.
``tests/test_vllm_negative_controls.py`` asserts that property with a real engine.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict

import torch

# Attention logits get std ~ (sqrt(hidden) * QK_STD)^2 (before 1/sqrt(head_dim) and RoPE):
# ~3.7 at hidden 256, so each query attends to a handful of positions.
QK_STD = 0.12


def context_model_config(*, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                      vocab: int = 1024, max_len: int = 4096) -> dict:
    """config.json of the test Llama (GQA when ``kv_heads < heads``)."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must divide by heads {heads}, heads by kv_heads {kv_heads}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }


def context_model_weights(config: dict, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded weights for ``config`` under the names LlamaForCausalLM loads."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def normal(shape, std):
        return (torch.randn(shape, generator=gen) * std).contiguous()

    w = {"model.embed_tokens.weight": normal((config["vocab_size"], hidden), 1.0),
         "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": normal((config["vocab_size"], hidden), 1.0 / math.sqrt(hidden))}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((q_out, hidden), QK_STD)
        w[p + "self_attn.k_proj.weight"] = normal((kv_out, hidden), QK_STD)
        # values and outputs carry the attended tokens into the residual at full weight
        w[p + "self_attn.v_proj.weight"] = normal((kv_out, hidden), 1.0 / math.sqrt(hidden))
        w[p + "self_attn.o_proj.weight"] = normal((hidden, q_out), 1.0 / math.sqrt(q_out))
        w[p + "mlp.gate_proj.weight"] = normal((inter, hidden), 1.0 / math.sqrt(hidden))
        w[p + "mlp.up_proj.weight"] = normal((inter, hidden), 1.0 / math.sqrt(hidden))
        w[p + "mlp.down_proj.weight"] = normal((hidden, inter), 0.5 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return w


def write_checkpoint(directory: str, config: dict, weights: dict) -> dict:
    """Write ``config`` as config.json and ``weights`` as model.safetensors into
    ``directory`` (a Hugging Face model directory vLLM loads); returns the config."""
    from safetensors.torch import save_file  # installed with vLLM / transformers

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(weights, os.path.join(directory, "model.safetensors"))
    return config


def write_context_model(directory: str, *, seed: int = 0, **config_kwargs) -> dict:
    """Write config.json and model.safetensors of the test Llama into ``directory``
    (keyword arguments as :func:`context_model_config`); returns the config."""
    config = context_model_config(**config_kwargs)
    return write_checkpoint(directory, config, context_model_weights(config, seed))

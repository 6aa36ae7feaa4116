"""A small Mellum checkpoint (interleaved sliding-window and full attention, dense MLP;
Hugging Face layout, safetensors) whose output depends on its context, for engine-level
tests of hybrid sliding-window KV caches (SGLang's ``SWAKVPool``: full layers keep every
token, sliding layers only the last ``sliding_window``).

Mellum (JetBrains) is Qwen3-MoE with per-layer attention types; every MLP here is dense
(``mlp_layer_types``), so no expert exists. As for the test Llama (hf_model.py), the
query/key projections and the q/k norms make attention sharp, so a missing, misplaced
or stale page changes the tokens; the window is small, so a prompt of a few hundred
tokens has sliding layers that forgot most of it.
"""
from __future__ import annotations

from typing import Dict

import torch

from .hf_model import context_model_config, context_model_weights, write_checkpoint

# q/k are RMS-normalised per head before the dot product: a gain of 2 on both gives
# logits of std ~4 at head_dim 64, so each query weighs few positions
QK_NORM_GAIN = 2.0


def swa_model_config(*, layers: int = 4, window: int = 64, **kwargs) -> dict:
    """config.json of the test Mellum: the test Llama's sizes (keyword arguments as
    :func:`~torch_kvops.testing.hf_model.context_model_config`), layers alternating
    sliding (even) and full (odd)."""
    config = context_model_config(layers=layers, **kwargs)
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    hidden = config["hidden_size"]
    config.update({
        "architectures": ["MellumForCausalLM"], "model_type": "mellum",
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "mlp_layer_types": ["dense"] * layers, "sliding_window": window,
        # the config class requires expert counts; no layer is sparse, so none exists
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
        "rope_parameters": {"full_attention": rope, "sliding_attention": dict(rope)},
        "rms_norm_eps": 1e-6, "attention_bias": False,
    })
    return config


def swa_model_weights(config: dict, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded weights for ``config`` under the names MellumForCausalLM loads: the test
    Llama's, with Qwen3's q/k norms."""
    w = context_model_weights(config, seed)
    head_dim = config["head_dim"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        w[p + "q_norm.weight"] = torch.full((head_dim,), QK_NORM_GAIN)
        w[p + "k_norm.weight"] = torch.full((head_dim,), QK_NORM_GAIN)
    return w


def write_swa_model(directory: str, *, seed: int = 0, **config_kwargs) -> dict:
    """Write config.json and model.safetensors of the test Mellum into ``directory``
    (keyword arguments as :func:`swa_model_config`); returns the config."""
    config = swa_model_config(**config_kwargs)
    return write_checkpoint(directory, config, swa_model_weights(config, seed))

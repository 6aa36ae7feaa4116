"""A test model directory that real clients can talk to: the context-sensitive Llama of
:mod:`torch_kvops.testing.hf_model` (or the MLA model of
:mod:`torch_kvops.testing.mla_model`, or the sliding-window model of
:mod:`torch_kvops.testing.swa_model`) plus a word-level tokenizer.

The tokenizer (``tokenizer.json``, Hugging Face ``tokenizers`` WordLevel model) maps each
whitespace-separated word to one token id: the model's vocabulary is ``<pad> <s> </s>
<unk>``, the chat roles, and ``w<N>`` words for the rest. So a text prompt of N words is
N tokens (unknown words become ``<unk>``), chat requests work through the template in
``tokenizer_config.json``, and vLLM's benchmark client can draw random token ids and
decode them to text that re-encodes to the same ids.
"""
from __future__ import annotations

import json
import os
import random
from typing import List

from ..testing.hf_model import write_context_model
from ..testing.mla_model import write_mla_model
from ..testing.swa_model import write_swa_model

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3; config.json: bos 1, eos 2
ROLES = ["system", "user", "assistant"]
# role words, then "assistant" opens the answer; no special token is added by encoding
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def vocabulary(size: int) -> List[str]:
    """The words of a vocabulary of ``size`` tokens, by id."""
    if size < len(SPECIALS) + len(ROLES) + 1:
        raise ValueError(f"vocabulary of {size} tokens is too small")
    words = SPECIALS + ROLES
    return words + [f"w{i}" for i in range(len(words), size)]


def tokenizer_json(size: int) -> dict:
    """tokenizer.json of the word-level tokenizer over :func:`vocabulary`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders  # installed with vLLM

    vocab = {w: i for i, w in enumerate(vocabulary(size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    return json.loads(tok.to_str())


def write_serving_model(directory: str, *, seed: int = 0, mla: bool = False, swa: bool = False,
                        **config_kwargs) -> dict:
    """Write the test Llama (weights, config.json), or with ``mla`` the test
    DeepSeek-V2-style MLA model, or with ``swa`` the test Mellum (sliding-window and
    full layers), and its tokenizer into ``directory`` (keyword arguments as
    :func:`torch_kvops.testing.hf_model.context_model_config`,
    :func:`torch_kvops.testing.mla_model.mla_model_config` or
    :func:`torch_kvops.testing.swa_model.swa_model_config`); returns the model config."""
    if mla and swa:
        raise ValueError("the test models are MLA or sliding-window, not both")
    write = write_mla_model if mla else write_swa_model if swa else write_context_model
    config = write(directory, seed=seed, **config_kwargs)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(config["vocab_size"]), f)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                  "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "model_max_length": config["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=1)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return config


def random_prompt(n_words: int, vocab_size: int, rng: random.Random) -> str:
    """A text prompt of ``n_words`` ordinary words (one token each)."""
    words = vocabulary(vocab_size)[len(SPECIALS) + len(ROLES):]
    return " ".join(rng.choice(words) for _ in range(n_words))

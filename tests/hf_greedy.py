"""Greedy answers of Hugging Face ``transformers`` for a model directory (run with the
SGLang environment's interpreter, whose transformers has the test model's class): an
engine-independent reference. Prompts as a JSON list on stdin, answers as one on stdout."""
from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the engines' ignore_eos: never stop early
    answers = []
    for prompt in json.load(sys.stdin):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()

"""Test and demo helpers (a small paged-KV Llama model); not imported by ``torch_kvops``."""

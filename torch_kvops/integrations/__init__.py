"""Adapters that load torch_kvops into serving engines (each imports its engine lazily:
``torch_kvops.integrations.vllm`` needs vLLM installed)."""

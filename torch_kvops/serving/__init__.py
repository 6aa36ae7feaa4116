"""Serving harnesses for vLLM with KvopsLayerwiseConnector.

- :mod:`.servers`: OpenAI API servers (``python -m vllm.entrypoints.openai.api_server``)
  for P (kv_producer), D (kv_consumer) and a monolithic reference, each in its own
  process group behind a watchdog (:mod:`.reaper`), stopped on every exit path.
- :mod:`.prometheus`: read a server's ``/metrics``.
- :mod:`.model`: the context-sensitive test Llama with a word-level tokenizer.
- :mod:`.proxy`: a P/D proxy (several P and D, least loaded, streaming, retries, aborts).
- :mod:`.offline`: in-process engines driven step by step (tests and benchmarks).
"""

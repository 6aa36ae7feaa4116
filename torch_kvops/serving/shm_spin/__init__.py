"""Benchmark aid: the sitecustomize.py here (put on PYTHONPATH by ServerSpec.shm_busy_loop_s)
shortens vLLM's message-queue busy-spin; see its docstring."""

"""Benchmark aid, not the product: shortens vLLM's shared-memory message-queue busy-spin
in the engine processes of a server started with ``ServerSpec(shm_busy_loop_s=...)``.

vLLM's multiprocess executor (the only one vLLM's CPU platform allows) has each reader of
its step queues spin with ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s, fixed in
vLLM 0.32) after every message: while an engine steps, its worker and engine core each
hold a core. On a 2-core host, P/D runs two engines per request, and their spinners take
the cores the computing one needs (docs/benchmarks.md, "Where the serving stalls went").
vllm-project/vllm#52814 (open) proposes the environment variable
``VLLM_SHM_BROADCAST_BUSY_LOOP_S``; this file applies that variable to vLLM versions that
do not read it, when ``vllm.distributed.device_communicators.shm_broadcast`` is imported.
It is on ``PYTHONPATH`` only for the servers that ask for it.
"""
import importlib.abc
import importlib.util
import os
import sys

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_VARIABLE = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def _patch(module) -> None:
    import vllm.envs as envs
    if _VARIABLE in getattr(envs, "environment_variables", {}):
        return  # vLLM reads it itself
    busy_loop_s = float(os.environ[_VARIABLE])
    original = module.SpinCondition.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = busy_loop_s

    module.SpinCondition.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            loader = spec.loader
            exec_module = loader.exec_module

            def patched_exec(module):
                exec_module(module)
                _patch(module)
            loader.exec_module = patched_exec
        return spec


if os.environ.get(_VARIABLE):
    sys.meta_path.insert(0, _Finder())

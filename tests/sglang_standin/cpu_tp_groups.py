"""TEST-ONLY stand-in, loaded as an SGLang plugin (``sglang.srt.plugins``) by the
SGLang tests with tensor parallelism: SGLang 0.5.23's ``init_model_parallel_group``
asks for PyNccl on every platform but NPU and XPU, so a CPU server with ``--tp-size
2`` fails at start-up (``torch.cuda.device('cpu')``). This turns PyNccl off, as SGLang
does for NPU and XPU: its groups then reduce over their gloo CPU groups (SGLang's own
code). Each rank also needs its cores named (``SGLANG_CPU_OMP_THREADS_BIND``, set by
the test)."""


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def without_pynccl(original, *args, **kwargs):
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group",
                          without_pynccl, HookType.AROUND)

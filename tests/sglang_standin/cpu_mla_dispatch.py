"""TEST-ONLY stand-in, loaded as an SGLang plugin (``sglang.srt.plugins``) by the
SGLang tests of MLA models: SGLang 0.5.23 runs DeepSeek attention on CPU only through
its ``intel_amx`` backend (AMX tiles and sglang-kernel-cpu, which has no wheel on
PyPI). Its ``torch_native`` backend computes MLA's absorbed form (queries and keys of
the latent's width), but SGLang's attention dispatch has no entry for it and falls back
to the Triton entry, which chooses the un-absorbed form for a prefill without a prefix:
that one reads the latent cache as keys and fails. This registers the absorbed form
(``AttnForwardMethod.MLA``, SGLang's own code) for ``torch_native``, in every server of
a test alike (the monolithic reference too). The latent cache and everything the
``kvops`` backend moves are as SGLang makes them."""


def install() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod)

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)

"""SGLang adapter: the transfer backend ``kvops`` for SGLang's prefill/decode
disaggregation (``--disaggregation-transfer-backend kvops``), loaded by SGLang as a
general plugin (entry point ``sglang.srt.plugins``: :func:`plugin.register`).
Everything it uses of SGLang is named in :mod:`.internals`."""

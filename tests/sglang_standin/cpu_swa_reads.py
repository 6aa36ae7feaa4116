"""TEST-ONLY stand-in, loaded as an SGLang plugin (``sglang.srt.plugins``) by the
SGLang tests of SGLang's hybrid sliding-window pool: SGLang 0.5.23's ``torch_native``
attention (its CPU backend here) reads a sliding layer's keys and values at the
request's full-pool slots (``req_to_token``), but a hybrid pool keeps that layer in
its window pool, at other slots (``SWAKVPool.translate_loc_from_full_to_swa``): it
reads the wrong tokens, and 11 of 12 answers of a monolithic server differed from
Hugging Face ``transformers``' (0 of 12 with this). This makes the backend read a
sliding layer through the translated table, in every server of a test alike (the
monolithic reference too); what the pools hold and what the ``kvops`` backend moves
are as SGLang makes them."""


def install() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    class _Table:  # what the backend reads of a req_to_token pool
        def __init__(self, req_to_token):
            self.req_to_token = req_to_token

    def through_the_window_pool(name):
        original = getattr(TorchNativeAttnBackend, name)

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            pool = self.token_to_kv_pool
            if not (isinstance(pool, SWAKVPool) and pool.layers_mapping[layer.layer_id][1]):
                return original(self, q, k, v, layer, forward_batch, save_kv_cache)
            full = self.req_to_token_pool
            table = full.req_to_token.to(pool.full_to_swa_index_mapping.device)
            self.req_to_token_pool = _Table(pool.translate_loc_from_full_to_swa(table))
            try:
                return original(self, q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                self.req_to_token_pool = full

        setattr(TorchNativeAttnBackend, name, forward)

    through_the_window_pool("forward_extend")
    through_the_window_pool("forward_decode")

"""Prefill/decode disaggregation with two real vLLM engines and KvopsLayerwiseConnector.

Starts three engine processes on one model (``--model DIR``, any Hugging Face Llama-style
directory; without it a small seeded test Llama whose output depends on its context,
torch_kvops/testing/hf_model.py): P (kv_producer), D (kv_consumer,
kv_load_failure_policy "recompute") and a monolithic reference. This process plays the proxy: for each prompt
it sends the request to D (do_remote_prefill) and then to P (do_remote_decode, one
token), and takes the output from D. Each prompt runs in every mode (monolithic, P/D
layer-wise, P/D push-after-forward) in interleaved rounds; TTFT is measured from the
proxy's send to the first token (CLOCK_MONOTONIC is shared by the processes).
Optionally (--kill-prefill) P is killed in the middle of a chunked prefill and D's
outcome is recorded. ``--compare-kv`` also compares D's KV cache for each prompt with
P's, block by block (the prompt tokens D received), and reports the first differing
layer and block. The last line printed is one JSON object.

    python examples/vllm_disagg.py --prompt-lens 33,700,1500 --max-num-batched-tokens 256

``--link 1gbit`` runs all of it inside a network namespace whose loopback is shaped to
that rate (torch_kvops/emulated_link.py, needs root): the script re-runs itself there,
so P's pushes, the control channel and the side channel cross the emulated link.

The engines and the comparison live in the package (torch_kvops/serving/offline.py,
torch_kvops/serving/pd_compare.py); this is ``python -m torch_kvops.serving.pd_compare``.
"""
from torch_kvops.serving.pd_compare import main

if __name__ == "__main__":
    main()

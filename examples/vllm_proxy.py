"""P/D proxy for `vllm serve` engines running KvopsLayerwiseConnector: several P and D,
least loaded, completions and chat, streaming, retries, aborts on client disconnect.

    python examples/vllm_proxy.py --prefill http://127.0.0.1:8100 \\
        --prefill-side-channel 127.0.0.1:7100 --decode http://127.0.0.1:8200 --port 8000

The same as ``python -m torch_kvops.serving.proxy`` (docs/vllm.md, "The proxy").
"""
from torch_kvops.serving.proxy import main

if __name__ == "__main__":
    main()

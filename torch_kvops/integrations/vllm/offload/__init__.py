"""KV offloading for vLLM's ``OffloadingConnector`` through ``swap_blocks_batch``:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvopsOffloadingSpec",
            "spec_module_path": "torch_kvops.integrations.vllm.offload",
            "cpu_bytes_to_use": 8000000000}}'

``spec`` (the OffloadingSpec: settings, sizing, the scheduler-side manager) and
``worker`` (vLLM's OffloadingWorker interface, failure policy) adapt vLLM to
``torch_kvops.offload`` (descriptors, host tier, copies), which does not import vLLM.
See docs/offload.md.
"""
from .spec import KvopsOffloadingSpec
from .worker import KvopsOffloadingWorker

__all__ = ["KvopsOffloadingSpec", "KvopsOffloadingWorker"]

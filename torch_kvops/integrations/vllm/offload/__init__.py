"""KV offloading for vLLM's ``OffloadingConnector`` through ``swap_blocks_batch``:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvopsOffloadingSpec",
            "spec_module_path": "torch_kvops.integrations.vllm.offload",
            "cpu_bytes_to_use": 8000000000}}'

Modules: ``spec`` (the OffloadingSpec: settings, sizing, the scheduler-side manager),
``worker`` (vLLM's OffloadingWorker interface, failure policy), ``tier`` (checks the
engine's KV tensors, allocates the host tier), ``descriptors`` (address arithmetic of a
job), ``copiers`` (host copies; CUDA/NPU side streams and events). See docs/offload.md.
"""
from .descriptors import CopyDescriptors, DescriptorBuilder, GroupRef, TierLayout, TierRegion
from .spec import KvopsOffloadingSpec
from .tier import HostTier, OffloadConfigError, build_host_tier
from .worker import KvopsOffloadingWorker, OffloadJobError

__all__ = [
    "CopyDescriptors", "DescriptorBuilder", "GroupRef", "HostTier", "KvopsOffloadingSpec",
    "KvopsOffloadingWorker", "OffloadConfigError", "OffloadJobError", "TierLayout", "TierRegion",
    "build_host_tier",
]

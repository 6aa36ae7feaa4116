"""Engine-independent KV offloading to a host-memory tier through
``swap_blocks_batch.ptrs``: ``descriptors`` (a job's address arithmetic), ``tier``
(checks the engine's KV tensors, allocates the host tier), ``copiers`` (host copies;
CUDA/NPU side streams and events), ``mover`` (store/load jobs, completion, failures).
vLLM's adapter is ``torch_kvops.integrations.vllm.offload``; this package does not
import vLLM, so it also runs where vLLM is not installed (the GPU tests)."""
from .descriptors import CopyDescriptors, DescriptorBuilder, GroupRef, TierLayout, TierRegion
from .mover import HostTierMover, OffloadJobError
from .tier import HostTier, OffloadConfigError, build_host_tier

__all__ = ["CopyDescriptors", "DescriptorBuilder", "GroupRef", "HostTier", "HostTierMover",
           "OffloadConfigError", "OffloadJobError", "TierLayout", "TierRegion", "build_host_tier"]

"""torch_kvops: batched KV-cache block copies and layer-wise KV transfer for PyTorch.

Importing the package loads the native extension, which registers the ``kvops`` ops
(``torch.ops.kvops.*``); ``ops`` adds their fake kernels and docstrings.
"""
import torch  # noqa: F401  (the extension links against torch's libraries)

from . import _C  # noqa: F401  registers the kvops schemas and kernels
from . import ops
from .connector import ConnectorConfig, LayerwiseConnector
from .events import LayerEvents
from .plan import TransferRequest
from .transports import MooncakeTransport, Transport, TransportError
from .ops import push_layer, record_layer_event, swap_blocks_batch, swap_blocks_batch_ptrs
from .policy import get_copy_policy, set_copy_policy

__all__ = [
    "ConnectorConfig",
    "LayerEvents",
    "LayerwiseConnector",
    "MooncakeTransport",
    "TransferRequest",
    "Transport",
    "TransportError",
    "ops",
    "push_layer",
    "record_layer_event",
    "swap_blocks_batch",
    "swap_blocks_batch_ptrs",
    "build_info",
    "get_copy_policy",
    "set_copy_policy",
]


def build_info() -> dict:
    """Which backends this build of the extension contains."""
    return dict(_C.build_info())

"""Transports that move KV-cache bytes between processes for the layer-wise connector.

``Transport``/``TransportError`` are the interface; ``MooncakeTransport`` implements it
over the Mooncake transfer engine (importing this package does not need Mooncake;
constructing a ``MooncakeTransport`` without it raises ImportError with an install hint).
"""
from .base import Transport, TransportError
from .mooncake import MOONCAKE_INSTALL_HINT, MooncakeTransport

__all__ = ["MOONCAKE_INSTALL_HINT", "MooncakeTransport", "Transport", "TransportError"]

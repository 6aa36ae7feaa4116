"""Transport interface: one-sided writes of registered host memory into a peer process.

A layer-wise KV connector's sender thread calls :meth:`Transport.write` with the byte
ranges of one layer's KV blocks; the main thread registers and unregisters the KV cache
memory and closes the transport. Implementations must allow exactly that split: one
thread calling ``write`` while another calls ``register``/``unregister``/``close``.
"""
from __future__ import annotations

import abc
from typing import Optional, Sequence

__all__ = ["Transport", "TransportError"]


class TransportError(RuntimeError):
    """A failed or timed-out transfer (or transport set-up).

    ``transient`` is True for errors worth retrying (timeouts, an unreachable or
    restarting peer, a dropped connection) and False for errors a retry cannot fix
    (unregistered or invalid memory, a closed transport, a failed initialization).
    ``peer`` names the peer address involved, if any.
    """

    def __init__(self, message: str, *, transient: bool, peer: Optional[str] = None):
        super().__init__(message)
        self.transient = bool(transient)
        self.peer = peer

    def __reduce__(self):  # keep the keyword-only fields through pickling
        return (_rebuild_transport_error, (str(self), self.transient, self.peer))


def _rebuild_transport_error(message: str, transient: bool, peer: Optional[str]) -> TransportError:
    return TransportError(message, transient=transient, peer=peer)


class Transport(abc.ABC):
    """One-sided write transport between processes.

    Memory written from (local ``src``) and into (the peer's ``dst``) must be
    registered with :meth:`register` on the respective side first.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def address(self) -> str:
        """What a peer passes as ``peer`` to :meth:`write`, e.g. ``"127.0.0.1:15002"``."""

    def supports_device(self, device_type: str) -> bool:
        """Whether memory of this device type ("cpu", "cuda", ...) can be registered
        and moved. The connector checks it before registering KV caches."""
        return device_type == "cpu"

    @abc.abstractmethod
    def register(self, ptr: int, length: int, *, exposed: bool = True) -> None:
        """Make ``[ptr, ptr + length)`` usable as a write source here and, unless
        ``exposed`` is False, as a write destination for peers. A transport keeps an
        unexposed region out of reach of its peers where it can. Idempotent per ``ptr``."""

    @abc.abstractmethod
    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` for the region starting at ``ptr``."""

    @abc.abstractmethod
    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              *, timeout_s: float) -> None:
        """One-sided write of local ``[src[k], src[k] + lengths[k])`` into the peer's
        ``[dst[k], dst[k] + lengths[k])`` for every ``k``.

        Returns only when every byte has landed; raises :class:`TransportError`
        (``transient=True`` for errors worth retrying, ``False`` for e.g. invalid or
        unregistered memory) within about ``timeout_s``. Never reports partial success.
        """

    def outstanding(self, peer: Optional[str] = None) -> int:
        """Transfers (toward ``peer``, or any) that failed or timed-out writes left
        running: they may still read their source and land at the peer. A transport
        whose ``write`` ends every transfer it started returns 0."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister everything this transport registered and release its resources.
        Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

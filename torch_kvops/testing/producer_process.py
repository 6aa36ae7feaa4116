"""A producer (prefill-side) LayerwiseConnector in its own process, driven over a pipe,
so that a test can freeze it (SIGSTOP), resume it (SIGCONT) or kill it while it pushes.
Its "model" writes each layer's blocks, hooks the layer, then waits ``gap_s`` (a slow
forward): the sender writes layer i while layer i+1 is still being computed."""
from __future__ import annotations

import time
import traceback

from .worker import WorkerProcess, serve


# the producer's side of the fence: what a test leaves on
FENCES = ("full", "lease", "off", "no_renewal")


def producer_main(pipe, num_layers, num_blocks, block_shape, config_kwargs, fence: str):
    import torch

    from ..connector import ConnectorConfig, LayerwiseConnector
    from ..connector.peer import PeerLink
    from ..control import ControlClient
    from ..plan import TransferRequest
    from ..transports import MooncakeTransport

    try:
        # Tests only: "lease" ignores the consumer's revokes (the write lease alone
        # stops the producer); "off" ignores every sign that the consumer let go: its
        # revokes, the write lease, a closed control channel (negative control);
        # "no_renewal": a step never asks for a new write lease (negative control).
        if fence == "no_renewal":
            PeerLink.write_lease_renewable = lambda self: False
        if fence in ("lease", "off"):
            PeerLink.acknowledge_revokes = lambda self: set()
        if fence == "off":
            PeerLink.check_write_lease = lambda self, what: None
            ControlClient.peer_closed = lambda self: False
        caches = [torch.zeros(num_blocks, *block_shape) for _ in range(num_layers)]
        transport = MooncakeTransport(host="127.0.0.1")
        connector = LayerwiseConnector("producer", transport, ConnectorConfig(**config_kwargs))
        connector.register_kv_caches(caches)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("ok", None))
    peers = {}

    def add_peer(info):
        peers[info["engine_id"]] = connector.add_peer(info)
        return peers[info["engine_id"]]

    def push(req_id, peer, src, dst, value, gap_s):
        """One step: every layer of ``src`` is set to ``value`` and pushed to ``dst``.
        Returns (finished, failed, stats) once the step is over."""
        connector.start_step([TransferRequest(req_id, peer, src, dst)])
        idx = torch.tensor(src, dtype=torch.long)
        for layer, cache in enumerate(caches):
            cache.index_fill_(0, idx, float(value))
            connector.save_kv_layer(layer, cache)
            time.sleep(gap_s)
        connector.wait_for_save(timeout=120)
        finished, failed = connector.get_finished()
        return sorted(finished), sorted(failed), connector.stats()

    def close():
        connector.close()
        transport.close()

    serve(pipe, {"add_peer": add_peer, "push": push}, close)


class ProducerProcess(WorkerProcess):
    """Handle on a producer process (``proc.pid`` for signals)."""

    def __init__(self, num_layers, num_blocks, block_shape, timeout=60.0, fence="full", **config_kwargs):
        if fence not in FENCES:
            raise ValueError(f"fence must be one of {FENCES}, got {fence!r}")
        super().__init__(producer_main, (num_layers, num_blocks, block_shape, config_kwargs, fence),
                         "producer", timeout)

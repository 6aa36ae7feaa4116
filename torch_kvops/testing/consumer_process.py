"""A consumer (decode-side) LayerwiseConnector in its own process, driven over a pipe.

Used by the connector tests and the transfer benchmarks: the producer runs in the
calling process, consumers run here, and the bytes travel through the real Mooncake
engine over loopback TCP.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback


def consumer_main(conn, num_layers, num_blocks, block_shape, config_kwargs, transport_kwargs):
    import torch

    from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport

    try:
        caches = [torch.full((num_blocks, *block_shape), -7.0) for _ in range(num_layers)]
        transport = MooncakeTransport(host="127.0.0.1", **transport_kwargs)
        connector = LayerwiseConnector("consumer", transport, ConnectorConfig(**config_kwargs))
        connector.register_kv_caches(caches)
        conn.send(("ok", connector.peer_info()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "expect":
                for req_id in args[0]:
                    connector.expect(req_id)
                conn.send(("ok", None))
            elif cmd == "wait":
                wanted, timeout = set(args[0]), args[1]
                finished, failed, times = set(), set(), {}
                deadline = time.monotonic() + timeout
                while not wanted <= (finished | failed) and time.monotonic() < deadline:
                    f, x = connector.get_finished()
                    for r in f | x:
                        times[r] = time.time()
                    finished |= f
                    failed |= x
                    time.sleep(0.002)
                conn.send(("ok", (finished, failed, times)))
            elif cmd == "caches":
                conn.send(("ok", [c.numpy().copy() for c in caches]))
            elif cmd == "stats":
                conn.send(("ok", connector.stats()))
            elif cmd == "close":
                connector.close()
                transport.close()
                conn.send(("ok", None))
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class ConsumerProcess:
    """Handle on a consumer process; every call has a timeout."""

    def __init__(self, num_layers, num_blocks, block_shape, timeout=60.0, transport_kwargs=None,
                 **config_kwargs):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout = timeout
        self.proc = ctx.Process(target=consumer_main,
                                args=(child, num_layers, num_blocks, block_shape, config_kwargs,
                                      transport_kwargs or {}),
                                daemon=True)
        self.proc.start()
        self.info = self._reply()

    def _reply(self, timeout=None):
        if not self._conn.poll(timeout or self.timeout):
            raise TimeoutError("consumer process did not answer")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"consumer process failed:\n{value}")
        return value

    def call(self, *cmd, timeout=None):
        self._conn.send(cmd)
        return self._reply(timeout)

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def stop(self):
        if self.proc.is_alive():
            try:
                self.call("close", timeout=20)
            finally:
                self.proc.join(10)
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join(10)

"""A consumer (decode-side) LayerwiseConnector in its own process, driven over a pipe.

Used by the connector tests and the transfer benchmarks: the producer runs in the
calling process, consumers run here, and the bytes travel through the real Mooncake
engine over loopback TCP.
"""
from __future__ import annotations

import os
import time
import traceback

from .worker import WorkerProcess, serve


# A hostile consumer (tests only): what it does to one kind of its control answers.
HOSTILE = {
    "rejected_not_list": ("begun", lambda m: dict(m, rejected=5)),
    "rejected_unhashable": ("begun", lambda m: dict(m, rejected=[["x"]])),
    "rejected_foreign": ("begun", lambda m: dict(m, rejected=["a-request-it-was-not-sent"])),
    "grant_s_bad": ("begun", lambda m: dict(m, grant_s="forever")),
    "ack_bad_slot": ("ack", lambda m: dict(m, slot=-1)),
    "ack_huge_slot": ("ack", lambda m: dict(m, slot=10 ** 9)),
    "ack_no_slot": ("ack", lambda m: {"op": "ack"}),
    "grant_huge": ("welcome", lambda m: dict(m, staging=dict(m["staging"], slots=1 << 20))
                   if m.get("staging") else m),
    "grant_malformed": ("welcome", lambda m: dict(m, staging={"address": "0", "slots": 2})),
}


def _mutations(specs: list):
    """Generated hostile answers (property-based tests): per spec, in every
    ``spec["op"]`` answer, field ``spec["field"]`` is set to ``spec["value"]``, or
    removed if ``spec.get("drop")``."""
    by_op = {}
    for spec in specs:
        by_op.setdefault(spec["op"], []).append(spec)

    def change(message):
        message = dict(message)
        for spec in by_op.get(message.get("op"), ()):
            if spec.get("drop"):
                message.pop(spec["field"], None)
            else:
                message[spec["field"]] = spec["value"]
        return message
    return by_op, change


def _make_hostile(how) -> None:
    """``how``: a HOSTILE name, or a list of mutation specs (:func:`_mutations`)."""
    from ..control.server import Session

    if isinstance(how, str):
        op, one = HOSTILE[how]
        ops, change = {op}, one
    else:
        ops, change = _mutations(how)
    reply = Session.reply

    def hostile_reply(self, message):
        reply(self, change(message) if message.get("op") in ops else message)

    Session.reply = hostile_reply


# Slow staging scatters (tests only), and the negative controls of what guards them.
SCATTER_CONTROLS = (None, "inline", "unfenced")


def _slow_scatters(seconds: float, control) -> None:
    """Each staging scatter waits ``seconds`` before its copy (a slow device copy).
    ``control``: "inline" runs scatters on the control thread, as before the scatter
    workers; "unfenced" reports a request without waiting for its running scatter."""
    from ..connector import consumer_scatter
    from ..staging import ConsumerStaging

    job = ConsumerStaging.scatter_job

    def slow_job(self, *args):
        copy = job(self, *args)

        def run():
            time.sleep(seconds)
            copy()
        return run

    ConsumerStaging.scatter_job = slow_job
    if control == "inline":
        consumer_scatter.ScatterWorkers.submit = lambda self, copy, done: (copy(), done(None))
    elif control == "unfenced":
        consumer_scatter.ConsumerScatter._end_waits_for_scatter_locked = staticmethod(
            lambda entry, ok, trust_landed: False)


def consumer_main(pipe, num_layers, num_blocks, block_shape, config_kwargs, transport_kwargs,
                  device="cpu", fleet_key=None, control_tls=None, hostile=None, netns=None,
                  slow_scatter=None, spaces=None):
    try:
        host = "127.0.0.1"
        if netns is not None:  # another host (netns_host.py): before any socket or thread
            from .netns_host import enter
            enter(netns[0])
            host = netns[1]
        import torch

        from ..connector import ConnectorConfig, LayerwiseConnector
        from ..transports import MooncakeTransport

        if hostile is not None:
            _make_hostile(hostile)
        if slow_scatter is not None:
            _slow_scatters(*slow_scatter)
        counts = num_blocks if isinstance(num_blocks, list) else [num_blocks] * num_layers
        caches = [torch.full((count, *block_shape), -7.0, device=device) for count in counts]
        transport = MooncakeTransport(host=host, **transport_kwargs)
        connector = LayerwiseConnector("consumer", transport, ConnectorConfig(**config_kwargs),
                                       fleet_key=fleet_key, control_tls=control_tls)
        connector.register_kv_caches(caches, spaces)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("ok", connector.peer_info()))

    def expect(req_ids, blocks=None):  # blocks: request -> the blocks the engine gave it
        return [connector.expect(req_id, blocks=(blocks or {}).get(req_id)) for req_id in req_ids]

    landed = {}  # failed request -> its landed chunks (connector.landed_chunks)

    def wait(req_ids, timeout):
        wanted, finished, failed, times = set(req_ids), set(), set(), {}
        deadline = time.monotonic() + timeout
        while not wanted <= (finished | failed) and time.monotonic() < deadline:
            done, bad = connector.get_finished()
            for r in done | bad:
                times[r] = time.time()
            landed.update((r, connector.landed_chunks(r)) for r in bad)
            finished |= done
            failed |= bad
            time.sleep(0.002)
        return finished, failed, times

    def drain():
        # Lists, not the sets wait() accumulates: a test counts how often an id came.
        finished, failed = connector.get_finished()
        landed.update((r, connector.landed_chunks(r)) for r in failed)
        return sorted(finished), sorted(failed)

    def close():
        connector.close()
        transport.close()

    def refuse(req_ids):
        connector.refuse(req_ids)

    def renew(req_ids):
        return [connector.renew(req_id) for req_id in req_ids]

    def fill(blocks, value):
        """Write ``value`` into ``blocks`` of every layer, as the engine would when it
        hands the blocks to another request (a sentinel for fence tests)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=device)
        for cache in caches:
            cache.index_fill_(0, idx, float(value))

    def wait_for_finished(timeout):
        started = time.monotonic()
        return connector.wait_for_finished(timeout), time.monotonic() - started

    serve(pipe, {"expect": expect, "refuse": refuse, "renew": renew, "wait": wait, "drain": drain, "stats": connector.stats,
                 "fill": fill,
                 "wait_for_finished": wait_for_finished,
                 "resources": process_resources, "landed": lambda: dict(landed),
                 "caches": lambda: [c.cpu().numpy().copy() for c in caches]}, close)


def process_resources(pid: "int | str" = "self") -> dict:
    """A process's threads (native ones included), open fds and resident memory, from
    /proc (Linux; this process by default): what a leak per step would grow."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_kib": int(status["VmRSS"].split()[0])}


class ConsumerProcess(WorkerProcess):
    """Handle on a consumer process; ``info`` is its ``peer_info()``."""

    def __init__(self, num_layers, num_blocks, block_shape, timeout=60.0, transport_kwargs=None,
                 device="cpu", fleet_key=None, control_tls=None, hostile=None, host=None,
                 slow_scatter=None, spaces=None, **config_kwargs):
        """``num_blocks``: per layer, or one count for all; ``host``: a
        :class:`~torch_kvops.testing.netns_host.NetnsHost` to run in; ``slow_scatter``:
        ``(seconds, control)`` (:func:`_slow_scatters`); ``spaces``: the layers' block
        spaces (``register_kv_caches``)."""
        netns = (host.name, host.address) if host is not None else None
        if slow_scatter is not None and slow_scatter[1] not in SCATTER_CONTROLS:
            raise ValueError(f"slow_scatter control must be one of {SCATTER_CONTROLS}")
        super().__init__(consumer_main, (num_layers, num_blocks, block_shape, config_kwargs,
                                         transport_kwargs or {}, device, fleet_key, control_tls, hostile,
                                         netns, slow_scatter, spaces),
                         "consumer", timeout)
        self.info = self.hello

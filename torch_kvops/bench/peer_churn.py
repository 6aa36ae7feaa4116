"""A producer's resources while consumers restart (issue 33): each restart of a decode
process is a new peer (a new engine id). One push per incarnation, then the process
goes away; with ``release_peers`` the producer closes the link. Returns per restart
the producer process's threads, open fds, resident memory and Mooncake registrations.

    python -m torch_kvops.bench.peer_churn [--restarts 50] [--keep]

tests/test_peer_churn.py runs it with 8 restarts (and without release, the negative
control); this runs the long loop outside ``make test``. One retry per write, as in
production (``max_retries`` is 2 by default). ``reused_addresses`` counts consumers
that got the data address (host and Mooncake port, picked at random by Mooncake) of
an earlier one: writes to such a consumer can fail against what Mooncake kept of the
earlier one (docs/mooncake-notes.md, "A peer restarted at the same address").
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 32, (2, 8, 16)  # 1 KiB blocks: fragmented layers are staged
CONFIG = dict(transfer_timeout_s=3.0, max_retries=1, control_timeout_s=2.0,
              staging_slot_bytes=64 << 10, staging_slots=4)
SRC, DST = [0, 2, 4, 6], [1, 3, 5, 7]


def churn(restarts: int, release: bool) -> List[Dict[str, int]]:
    """``restarts`` consumer processes one after the other, one push each; the
    producer's resources after each."""
    import torch

    from ..connector import ConnectorConfig, LayerwiseConnector
    from ..plan import TransferRequest
    from ..transports import MooncakeTransport
    from ..testing.consumer_process import ConsumerProcess, process_resources

    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    samples, addresses = [], set()
    try:
        conn.register_kv_caches(caches)
        for i in range(restarts):
            consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
            # a data address an earlier consumer had: Mooncake holds its old segment
            reused = consumer.info["data_address"] in addresses
            addresses.add(consumer.info["data_address"])
            try:
                peer = conn.add_peer(consumer.info)
                consumer.call("expect", [f"r{i}"])
                conn.start_step([TransferRequest(f"r{i}", peer, SRC, DST)])
                for layer, cache in enumerate(caches):
                    conn.save_kv_layer(layer, cache)
                conn.wait_for_save(timeout=30)
                if consumer.call("wait", [f"r{i}"], 10.0)[0] != {f"r{i}"}:
                    raise RuntimeError(f"restart {i}: the push did not land")
            finally:
                consumer.stop()  # the decode process goes away (a restart brings a new one)
            conn.get_finished()
            if release and (conn.release_peers(idle_s=0.0) != [peer] or not conn.wait_for_release(30.0)):
                raise RuntimeError(f"restart {i}: its link was not released")
            samples.append(dict(process_resources(), regions=len(transport._registry.index.ptrs()),
                                retries=conn.stats()["retries"], reused_addresses=int(reused)))
    finally:
        conn.close()
        transport.close()
    return samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--restarts", type=int, default=50)
    p.add_argument("--keep", action="store_true", help="do not release links (the negative control)")
    args = p.parse_args(argv)
    samples = churn(args.restarts, release=not args.keep)
    first, last = samples[0], samples[-1]
    print(json.dumps({"restarts": args.restarts, "release": not args.keep, "after_first": first,
                      "after_last": last,
                      "growth": {k: last[k] - first[k] for k in first},
                      "reused_addresses": sum(s["reused_addresses"] for s in samples)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

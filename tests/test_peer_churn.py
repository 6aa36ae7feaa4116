"""Consumers come and go (issue 33): each restart of a decode process is a new peer
for the producer. With ``release_peers`` the producer's threads and Mooncake
registrations after the last of RESTARTS restarts equal those after the first; the
negative control (no release) keeps every peer's staging registration. One fd per new
peer remains either way: the data socket Mooncake's engine opened to it, which its
Python API (checked: ``TransferEngine``'s methods) cannot close short of destroying
the engine. Real consumer processes over the real Mooncake engine."""
import pytest

from torch_kvops.bench.peer_churn import churn

RESTARTS = 8  # python -m torch_kvops.bench.peer_churn runs 50


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_producer_resources_stay_flat_while_consumers_restart(release):
    samples = churn(RESTARTS, release)
    first, last = samples[0], samples[-1]
    print(f"release={release}: after restart 1 {first}, after restart {RESTARTS} {last}")
    # at most Mooncake's data socket per new peer (see the module docstring)
    assert last["fds"] - first["fds"] <= RESTARTS - 1, (first, last)
    assert last["threads"] - first["threads"] <= 2, (first, last)
    if release:
        assert last["regions"] == first["regions"], (first, last)
    else:  # negative control: every peer's staging registration stays
        assert last["regions"] - first["regions"] == RESTARTS - 1, (first, last)


def test_links_beyond_the_bound_are_released_least_recently_used_first():
    """Three consumers pushed to in the order a, b, c: with two links kept, a goes;
    links still used stay, and the released one connects again on demand."""
    import torch

    from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
    from torch_kvops.bench.peer_churn import BLOCK_SHAPE, BLOCKS, CONFIG, DST, LAYERS, SRC
    from torch_kvops.testing.consumer_process import ConsumerProcess

    consumers = [ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG) for _ in range(3)]
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    try:
        conn.register_kv_caches(caches)
        peers = [conn.add_peer(c.info) for c in consumers]

        def push(k, req_id):
            consumers[k].call("expect", [req_id])
            conn.start_step([TransferRequest(req_id, peers[k], SRC, DST)])
            for layer, cache in enumerate(caches):
                conn.save_kv_layer(layer, cache)
            conn.wait_for_save(timeout=30)
            assert consumers[k].call("wait", [req_id], 10.0)[0] == {req_id}

        for k in range(3):
            push(k, f"r{k}")
        conn.get_finished()
        assert conn.release_peers(idle_s=1e9) == []  # none idle, no bound
        assert conn.release_peers(idle_s=1e9, keep=2) == [peers[0]]
        assert conn.release_peers(idle_s=1e9, keep=2) == []
        assert conn.add_peer(consumers[0].info) == peers[0]  # connected again on demand
        push(0, "again")
    finally:
        conn.close()
        transport.close()
        for c in consumers:
            c.stop()


def test_concurrent_add_peer_of_one_consumer_makes_one_link():
    """Threads that learn of one consumer at once (SGLang's decode ranks register with
    every prefill rank, and again) each call ``add_peer``: one attempt runs, the others
    get its peer. Without that, each made its own link, the consumer kept only the last
    handshake (``control_replaced``) and a push over an earlier link failed."""
    import threading

    import torch

    from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
    from torch_kvops.bench.peer_churn import BLOCK_SHAPE, BLOCKS, CONFIG, DST, LAYERS, SRC
    from torch_kvops.testing.consumer_process import ConsumerProcess

    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    try:
        conn.register_kv_caches(caches)
        start, ids = threading.Barrier(8), []

        def add():
            start.wait()
            ids.append(conn.add_peer(consumer.info))

        threads = [threading.Thread(target=add) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(ids) == 8 and len(set(ids)) == 1, ids
        assert consumer.call("stats").get("control_replaced", 0) == 0
        consumer.call("expect", ["r"])
        conn.start_step([TransferRequest("r", ids[0], SRC, DST)])
        for layer, cache in enumerate(caches):
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)
        assert consumer.call("wait", ["r"], 10.0)[0] == {"r"}
        received = consumer.call("caches")
        for layer in range(LAYERS):
            assert (received[layer][DST] == caches[layer][SRC].numpy()).all()
    finally:
        conn.close()
        transport.close()
        consumer.stop()

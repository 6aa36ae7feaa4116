"""Consumers come and go (issue 33): each restart of a decode process is a new peer
for the producer. With ``release_peers`` the producer's threads and Mooncake
registrations after the last of RESTARTS restarts equal those after the first; the
negative control (no release) keeps every peer's staging registration. One fd per new
peer remains either way: the data socket Mooncake's engine opened to it, which its
Python API (checked: ``TransferEngine``'s methods) cannot close short of destroying
the engine. Real consumer processes over the real Mooncake engine."""
import pytest

from torch_kvops.bench.peer_churn import churn

pytestmark = [pytest.mark.process]

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


def test_a_staging_area_costs_resident_memory_only_where_slots_are_written():
    """Each link's staging on the CPU path (64 MiB granted by the consumer, mirrored by
    the producer) is allocated, not written, when the link is made: the pages become
    resident only where gathers and scatters write them, so resident memory follows
    use (pinned CUDA staging is resident at once: not covered here). A push of 0.25 MiB
    per layer costs about that per slot used, on both sides."""
    import torch

    from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
    from torch_kvops.testing.consumer_process import ConsumerProcess, process_resources
    from torch_kvops.testing.pushes import push_and_receive

    layers, blocks, shape = 4, 64, (2, 8, 256)  # 16 KiB blocks
    consumer = ConsumerProcess(layers, blocks, shape)
    transport = MooncakeTransport(host="127.0.0.1")
    conn = LayerwiseConnector("producer", transport, ConnectorConfig())
    caches = [torch.randn(blocks, *shape) for _ in range(layers)]
    try:
        conn.register_kv_caches(caches)
        mib = lambda r: r["rss_kib"] / 1024  # noqa: E731
        consumer_before, producer_before = mib(consumer.call("resources")), mib(process_resources())
        peer = conn.add_peer(consumer.info)
        granted = ConnectorConfig().staging_slots * ConnectorConfig().staging_slot_bytes >> 20
        consumer_linked, producer_linked = mib(consumer.call("resources")), mib(process_resources())
        consumer.call("expect", ["r"])
        # 16 fragmented blocks per layer (staged): 0.25 MiB into each of 4 slots
        push_and_receive(conn, caches, consumer, TransferRequest("r", peer, list(range(0, 32, 2)),
                                                                 list(range(33, 64, 2))))
        consumer_used, producer_used = mib(consumer.call("resources")), mib(process_resources())
        assert conn.stats()["staged_writes"] == layers, "the push did not go through staging"
        print(f"{granted} MiB staging per side; consumer RSS {consumer_before:.0f} -> linked "
              f"{consumer_linked:.0f} -> after the push {consumer_used:.0f} MiB; producer "
              f"{producer_before:.0f} -> {producer_linked:.0f} -> {producer_used:.0f} MiB")
        assert consumer_linked - consumer_before < granted / 8, "the consumer's grant became resident"
        assert producer_linked - producer_before < granted / 8, "the producer's mirror became resident"
        assert consumer_used - consumer_before < granted / 4
    finally:
        conn.close()
        transport.close()
        consumer.stop()


@pytest.mark.parametrize("unregister_wait_s", [35.0, 0.5], ids=["waits_out_the_transfer", "kept_and_closed_again"])
def test_letting_go_of_a_link_a_stalled_write_still_reads_never_waits_on_the_callers_thread(unregister_wait_s):
    """Issue 58: a consumer frozen (SIGSTOP) between two layers of a push. The second
    layer's staged write times out and leaves its transfer in a Mooncake lane, reading
    the link's staging buffer. ``release_peers`` (the engine's thread, between steps)
    returns at once: it used to unregister the buffer there, waiting until the transfer
    ended (the consumer is killed ``hold_s`` later). The link is closed in the
    background once nothing reads it, and its registration is gone; with an unregister
    that gives up before the transfer ends, the link (its buffer with it) is kept and
    closed again."""
    import os
    import signal
    import threading
    import time

    import torch

    from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
    from torch_kvops.bench.peer_churn import BLOCK_SHAPE, BLOCKS, DST, LAYERS, SRC
    from torch_kvops.testing.consumer_process import ConsumerProcess

    hold_s = 3.0
    config = dict(transfer_timeout_s=1.0, max_retries=0, control_timeout_s=2.0, quarantine_s=0.1,
                  staging_slot_bytes=64 << 10, staging_slots=4)
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **config)
    transport = MooncakeTransport(host="127.0.0.1", close_timeout_s=unregister_wait_s)
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**config))
    killer = threading.Timer(hold_s, consumer.kill)
    try:
        conn.register_kv_caches(caches)
        regions = len(transport._registry.index.ptrs())
        peer = conn.add_peer(consumer.info)
        assert len(transport._registry.index.ptrs()) == regions + 1, "the link's staging buffer"
        consumer.call("expect", ["r"])
        conn.start_step([TransferRequest("r", peer, SRC, DST)])
        conn.save_kv_layer(0, caches[0])
        deadline = time.monotonic() + 10
        while not (consumer.call("caches")[0][DST] == caches[0][SRC].numpy()).all():
            assert time.monotonic() < deadline, "layer 0 never landed"
            time.sleep(0.01)
        os.kill(consumer.proc.pid, signal.SIGSTOP)
        conn.save_kv_layer(1, caches[1])
        conn.wait_for_save(timeout=30)
        assert transport.outstanding() > 0, "the timed-out write's transfer still reads the buffer"
        deadline = time.monotonic() + 10
        while "r" not in conn.get_finished()[1]:
            assert time.monotonic() < deadline, "the request to the frozen consumer must fail"
            time.sleep(0.01)
        killer.start()
        started = time.monotonic()
        released = conn.release_peers(idle_s=0.0)
        took = time.monotonic() - started
        print(f"release_peers beside a transfer still reading the buffer: {took * 1e3:.2f} ms "
              f"(the transfer ended {hold_s:.0f} s later)")
        assert released == [peer]
        assert took < hold_s / 4, f"release_peers waited {took:.2f} s for the transfer"
        assert conn.wait_for_release(hold_s + 30), "the link is closed once nothing reads it"
        assert len(transport._registry.index.ptrs()) == regions and transport.outstanding() == 0
        assert (conn.stats().get("link_release_retries", 0) > 0) == (unregister_wait_s < hold_s)
    finally:
        killer.cancel()
        conn.close()
        transport.close()
        consumer.kill()

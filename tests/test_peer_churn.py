"""Consumers come and go (issue 33): each restart of a decode process is a new peer
for the producer. With ``release_peers`` the producer's threads and Mooncake
registrations after the last of RESTARTS restarts equal those after the first; the
negative control (no release) keeps every peer's staging registration. One fd per new
peer remains either way: the data socket Mooncake's engine opened to it, which its
Python API (checked: ``TransferEngine``'s methods) cannot close short of destroying
the engine. Real consumer processes over the real Mooncake engine."""
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import ConsumerProcess, process_resources

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 32, (2, 8, 16)  # 1 KiB blocks: fragmented layers are staged
CONFIG = dict(transfer_timeout_s=3.0, max_retries=0, control_timeout_s=2.0,
              staging_slot_bytes=64 << 10, staging_slots=4)
RESTARTS = 8
SRC, DST = [0, 2, 4, 6], [1, 3, 5, 7]


def _churn(release: bool):
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    samples = []
    try:
        conn.register_kv_caches(caches)
        for i in range(RESTARTS):
            consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
            try:
                peer = conn.add_peer(consumer.info)
                consumer.call("expect", [f"r{i}"])
                conn.start_step([TransferRequest(f"r{i}", peer, SRC, DST)])
                for layer, cache in enumerate(caches):
                    conn.save_kv_layer(layer, cache)
                conn.wait_for_save(timeout=30)
                assert consumer.call("wait", [f"r{i}"], 10.0)[0] == {f"r{i}"}
            finally:
                consumer.stop()  # the decode process goes away (a restart brings a new one)
            conn.get_finished()
            if release:
                assert conn.release_peers(idle_s=0.0) == [peer]
            samples.append(dict(process_resources(), regions=len(transport._registry.index.ptrs())))
    finally:
        conn.close()
        transport.close()
    return samples


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_producer_resources_stay_flat_while_consumers_restart(release):
    samples = _churn(release)
    first, last = samples[0], samples[-1]
    print(f"release={release}: after restart 1 {first}, after restart {RESTARTS} {last}")
    # at most Mooncake's data socket per new peer (see the module docstring)
    assert last["fds"] - first["fds"] <= RESTARTS - 1, (first, last)
    assert last["threads"] - first["threads"] <= 2, (first, last)
    if release:
        assert last["regions"] == first["regions"], (first, last)
    else:  # negative control: every peer's staging registration stays
        assert last["regions"] - first["regions"] == RESTARTS - 1, (first, last)

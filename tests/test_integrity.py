"""The optional end-to-end integrity check (ConnectorConfig.integrity_check) between
real processes over the real Mooncake engine.

Sabotage is applied from this test to the producer's transport (bytes not written,
or written one block off): with the check on, in either mode ("checksum" or "mac"),
the consumer must report the request failed and count it; with the check off, the same
sabotage goes unnoticed by the connector (the control that shows the check is what
catches it). A producer that digests with a key other than the consumer's (a writer
who knows the bytes but not the key) is refused in "mac" mode and passes in
"checksum" mode, which is documented as no protection against tampering.
"""
import contextlib
import threading

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.connector import producer as producer_module
from torch_kvops.connector.integrity import ChecksumDigester, MacDigester, integrity_key, make_digester
from torch_kvops.testing.consumer_process import ConsumerProcess

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 3, 64, (2, 8, 16)  # 1 KiB blocks
BLOCK_BYTES = 2 * 8 * 16 * 4
FAST = dict(transfer_timeout_s=3.0, max_retries=0, retry_backoff_s=0.02, lease_s=10.0,
            control_timeout_s=2.0, quarantine_s=0.05)
PATHS = {"staged": {}, "direct": {"staging_threshold_bytes": 0}}
SRC, DST = [0, 1, 2, 7, 30], [10, 11, 12, 20, 40]  # chunk 1: first three, chunk 2: the rest
MODES = ["checksum", "mac"]


def sabotage(transport, how):
    """Replace ``transport.write`` (this process only) with a faulty one."""
    original = transport.write

    def drop(peer, src, dst, lengths, **kw):
        return None  # reports success, moves nothing

    def misplace(peer, src, dst, lengths, **kw):
        return original(peer, src, [int(d) + BLOCK_BYTES for d in dst], lengths, **kw)

    transport.write = {"drop": drop, "misplace": misplace}[how]


def push_two_chunks(conn, caches, peer):
    gen = torch.Generator().manual_seed(5)
    for src, dst, last in ((SRC[:3], DST[:3], False), (SRC[3:], DST[3:], True)):
        conn.start_step([TransferRequest("r", peer, src, dst, last_chunk=last)])
        idx = torch.tensor(src)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, idx, torch.randn(len(src), *BLOCK_SHAPE, generator=gen))
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)


@contextlib.contextmanager
def linked(path: str, how, consumer_check, producer_check):
    """A producer connector in this process linked to a consumer process, "r" expected
    there, ``how`` (if any) sabotaging this process's writes: (producer, its caches,
    the consumer's peer id, the consumer)."""
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, integrity_check=consumer_check,
                               **FAST, **PATHS[path])
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        config = ConnectorConfig(integrity_check=producer_check, **FAST, **PATHS[path])
        with LayerwiseConnector("producer", transport, config) as conn:
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)
            consumer.call("expect", ["r"])
            if how:
                sabotage(transport, how)
            yield conn, caches, peer, consumer
    finally:
        consumer.stop()
        transport.close()


def run(path: str, how, consumer_check, producer_check):
    """Push request "r" in two chunks; returns (finished, failed, consumer stats, whether
    each block landed right)."""
    with linked(path, how, consumer_check, producer_check) as (conn, caches, peer, consumer):
        push_two_chunks(conn, caches, peer)
        finished, failed, _ = consumer.call("wait", ["r"], 15.0)
        received = consumer.call("caches")
        right = [all(np.array_equal(received[layer][d], caches[layer][s].numpy())
                     for layer in range(LAYERS)) for s, d in zip(SRC, DST)]
        return finished, failed, consumer.call("stats"), right


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("how", ["drop", "misplace"])
def test_sabotaged_writes_fail_the_request_when_the_check_is_on(path, how, mode):
    finished, failed, stats, right = run(path, how, consumer_check=mode, producer_check=False)
    assert not all(right), "the sabotage did not corrupt the blocks: this test proves nothing"
    assert failed == {"r"} and not finished
    assert stats["integrity_failures"] == 1


def test_without_the_check_the_same_sabotage_is_reported_finished():
    finished, failed, stats, right = run("staged", "misplace", consumer_check=False, producer_check=False)
    assert not all(right) and finished == {"r"} and not failed
    assert stats["integrity_failures"] == 0


@pytest.mark.parametrize("path,consumer_check,producer_check",
                         [("staged", "checksum", False), ("direct", False, "checksum"),
                          ("staged", "checksum", "mac"), ("direct", False, True)],
                         ids=["staged-consumer-asks-checksum", "direct-producer-offers-checksum",
                              "staged-stronger-mode-wins", "direct-producer-offers-True-as-mac"])
def test_intact_pushes_pass_the_check(path, consumer_check, producer_check):
    finished, failed, stats, right = run(path, None, consumer_check, producer_check)
    assert all(right) and finished == {"r"} and not failed
    assert stats["integrity_failures"] == 0 and stats["integrity_us"] > 0
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvops-digest")]
    assert not left, f"the producer's digest worker outlived its connector: {left}"


@pytest.mark.parametrize("mode", MODES)
def test_a_digest_made_without_the_key_is_refused_by_mac_only(monkeypatch, mode):
    """The producer digests the bytes it really pushes, but keyed with a guess instead of
    the consumer's secret: what a writer that knows the data and not the key can do."""
    monkeypatch.setattr(producer_module, "make_digester",
                        lambda m, caches, secret, **kw: make_digester(m, caches, "a guessed secret", **kw))
    finished, failed, stats, right = run("direct", None, consumer_check=mode, producer_check=mode)
    if mode == "mac":
        assert failed == {"r"} and not finished and stats["integrity_failures"] == 1
        # refused at the first chunk's first layer (its second chunk is never sent)
        assert all(right[:3]), "the bytes were pushed intact: only the digests are forged"
    else:
        assert all(right), "the bytes were pushed intact: only the digests are forged"  # documented: a checksum is not keyed, anyone who knows the bytes can make it
        assert finished == {"r"} and not failed and stats["integrity_failures"] == 0


def test_a_chunk_without_the_digests_of_every_layer_fails(monkeypatch):
    """A producer that skips one layer's digests: its bytes are intact, yet the layer
    is unverified, so the request fails."""
    submit = producer_module.DigestPipeline.submit

    def skip_last_layer(self, peer, layer, req_blocks, firsts=None):
        if layer != LAYERS - 1:
            submit(self, peer, layer, req_blocks, firsts)

    monkeypatch.setattr(producer_module.DigestPipeline, "submit", skip_last_layer)
    finished, failed, stats, right = run("direct", None, consumer_check="checksum", producer_check=False)
    assert all(right[:3]) and failed == {"r"} and not finished and stats["integrity_failures"] == 1


def test_mac_digests_are_keyed_and_cover_every_layer():
    caches = [torch.randn(4, 8) for _ in range(3)]
    blocks = np.array([1, 2])

    def digests(key: str):
        d = MacDigester(caches, integrity_key(key))
        return [d.layer_digests(layer, blocks) for layer in range(3)]

    a = digests("secret-a")
    assert a == digests("secret-a") and a != digests("secret-b")
    assert len({bytes(x) for x in a}) == 3, "equal bytes in two layers would digest alike"
    caches[2][1, 3] += 1.0  # one element of block 1 of the last layer
    b = digests("secret-a")
    assert b[:2] == a[:2] and b[2][:16] != a[2][:16] and b[2][16:] == a[2][16:]


def test_checksums_are_unkeyed_per_layer_and_cover_every_block():
    caches = [torch.randn(4, 8) for _ in range(3)]
    caches[1].copy_(caches[0])  # equal bytes in two layers: the layer seeds tell them apart
    d = ChecksumDigester(caches)
    a = [d.layer_digests(layer, np.array([1, 2])) for layer in range(3)]
    assert a[0] != a[1]
    assert a == [ChecksumDigester(caches).layer_digests(layer, np.array([1, 2])) for layer in range(3)]
    caches[2][1, 3] += 1.0
    b = d.layer_digests(2, np.array([1, 2]))
    assert b[:16] != a[2][:16] and b[16:] == a[2][16:]


def test_integrity_check_values():
    assert ConnectorConfig(integrity_check=True).integrity_mode == "mac"
    assert ConnectorConfig(integrity_check=False).integrity_mode == "off"
    assert ConnectorConfig(integrity_check="checksum").integrity_mode == "checksum"
    with pytest.raises(ValueError, match="integrity_check must be one of"):
        ConnectorConfig(integrity_check="crc")


@pytest.mark.parametrize("mode", MODES)
def test_device_caches_are_refused_with_the_setting_named(mode):
    caches = [torch.zeros(4, 8, device="meta")]
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(integrity_check=mode))
        with pytest.raises(ValueError, match="integrity_check"):
            conn.register_kv_caches(caches)
    finally:
        transport.close()

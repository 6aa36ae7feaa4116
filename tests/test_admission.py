"""Admission of ``begin`` on the consumer (connector/consumer_admission.py), between real
processes over Mooncake TCP: with ``begin_waits_for_expect_s`` set (the vLLM
integration sets it), a producer's begin for a request the consumer never expected is
held, then rejected: the producer writes nothing, and the blocks it named keep their
bytes. A begin that arrives before the engine's ``expect()`` (a producer faster than
the consumer's engine) waits for it and lands, even when the engine is later than the
producer's transfer timeout and the consumer's lease (the hold counts toward neither).
The control: without the setting the
unexpected request's bytes land in the named blocks, which the engine may have given
to any other request."""
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.pushes import push_step

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 16, (2, 4, 16)
FAST = dict(transfer_timeout_s=3.0, max_retries=1, lease_s=10.0, control_timeout_s=2.0, quarantine_s=0.1)
UNTOUCHED = -7.0  # the consumer's caches start so


@pytest.fixture
def producer(request):
    settings = getattr(request, "param", FAST)
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.full((BLOCKS, *BLOCK_SHAPE), float(layer + 1)) for layer in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**settings))
    conn.register_kv_caches(caches)
    yield conn, caches
    conn.close()
    transport.close()


def _outcome(conn, req_id, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = conn.get_finished()
        if req_id in done | failed:
            return req_id in done
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not reported by the producer within {timeout} s")


@pytest.mark.parametrize("wait_s", [1.0, None], ids=["held_then_rejected", "control_admitted"])
def test_a_begin_for_a_request_nobody_expected_writes_nothing(producer, wait_s):
    conn, caches = producer
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, begin_waits_for_expect_s=wait_s, **FAST)
    try:
        peer = conn.add_peer(consumer.info)
        started = time.monotonic()
        push_step(conn, caches, [TransferRequest("stranger", peer, [1, 2], [5, 6])])
        ok = _outcome(conn, "stranger")
        received = consumer.call("caches")
        landed = [bool((received[layer][[5, 6]] != UNTOUCHED).any()) for layer in range(LAYERS)]
        if wait_s is None:
            assert ok and all(landed), "the control: an unexpected request's bytes land"
            return
        assert not ok and not any(landed), "bytes of a request the consumer never expected landed"
        assert time.monotonic() - started >= wait_s  # held that long first
        assert consumer.call("stats")["failed_begin_unexpected"] == 1
    finally:
        consumer.stop()


# an engine 2 s behind its producer: longer than the producer's transfer timeout and the
# consumer's lease, shorter than the hold and the producer's wait for the answer
BEHIND = dict(FAST, transfer_timeout_s=1.0, lease_s=1.5, begin_timeout_s=5.0)


@pytest.mark.parametrize("producer,behind_s,settings,hold_s",
                         [(FAST, 0.3, FAST, 2.0), (BEHIND, 2.0, BEHIND, 4.0)],
                         ids=["one_step_behind", "behind_the_timeouts"], indirect=["producer"])
def test_a_begin_ahead_of_the_engines_expect_waits_for_it_and_lands(producer, behind_s, settings,
                                                                    hold_s):
    conn, caches = producer
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, begin_waits_for_expect_s=hold_s, **settings)
    try:
        peer = conn.add_peer(consumer.info)
        conn.start_step([TransferRequest("late", peer, [3, 4], [9, 10])])  # the begin goes out now
        time.sleep(behind_s)  # the consumer's engine learns of the request later
        assert consumer.call("expect", ["late"]) == [True]
        for layer, cache in enumerate(caches):
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)
        assert _outcome(conn, "late")
        finished, failed, _ = consumer.call("wait", ["late"], 10.0)
        assert finished == {"late"} and not failed
        received = consumer.call("caches")
        for layer in range(LAYERS):
            assert np.all(received[layer][[9, 10]] == layer + 1)
    finally:
        consumer.stop()


def test_the_wait_must_be_shorter_than_the_producers_answer_timeout():
    with pytest.raises(ValueError, match="begin_waits_for_expect_s"):
        ConnectorConfig(begin_timeout_s=1.0, begin_waits_for_expect_s=1.5)
    with pytest.raises(ValueError, match="begin_waits_for_expect_s"):  # no begin_timeout_s
        ConnectorConfig(transfer_timeout_s=1.0, begin_waits_for_expect_s=1.5)

"""Admission of ``begin`` on the consumer (connector/consumer_admission.py), between real
processes over Mooncake TCP: with ``begin_waits_for_expect_s`` set (the vLLM
integration sets it), a producer's begin for a request the consumer never expected is
held, then rejected: the producer writes nothing, and the blocks it named keep their
bytes. A begin that arrives before the engine's ``expect()`` (a producer faster than
the consumer's engine) waits for it and lands, even when the engine is later than the
producer's transfer timeout and the consumer's lease (the hold counts toward neither).
The control: without the setting the
unexpected request's bytes land in the named blocks, which the engine may have given
to any other request.

A begin that names destination blocks the engine did not give the request (``expect``
with ``blocks``: a wrong plan, a stale or misrouted destination) is rejected before a
byte is written, and the request fails on both sides; named in a later chunk, after
earlier chunks landed, it fails once the fence ends. The control: expected without
its blocks, the misaddressed bytes land."""
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.pushes import producer_outcome, push_step

pytestmark = [pytest.mark.process]

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


@pytest.mark.parametrize("wait_s", [1.0, None, "unsolicited"],
                         ids=["held_then_rejected", "default_rejected", "control_opted_in"])
def test_a_begin_for_a_request_nobody_expected_writes_nothing(producer, wait_s):
    """By default (nothing set, as a new user of the core starts) too; the control
    opts in to unsolicited pushes (``accept_unsolicited_pushes``) and the bytes land."""
    conn, caches = producer
    settings = ({"accept_unsolicited_pushes": True} if wait_s == "unsolicited"
                else {} if wait_s is None else {"begin_waits_for_expect_s": wait_s})
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **settings, **FAST)
    try:
        peer = conn.add_peer(consumer.info)
        started = time.monotonic()
        push_step(conn, caches, [TransferRequest("stranger", peer, [1, 2], [5, 6])])
        ok = producer_outcome(conn, "stranger")
        received = consumer.call("caches")
        landed = [bool((received[layer][[5, 6]] != UNTOUCHED).any()) for layer in range(LAYERS)]
        if wait_s == "unsolicited":
            assert ok and all(landed), "the control: an unexpected request's bytes land"
            return
        assert not ok and not any(landed), "bytes of a request the consumer never expected landed"
        assert time.monotonic() - started >= (wait_s or 0.0)  # held that long first
        assert consumer.call("stats")["failed_begin_unexpected"] == 1
    finally:
        consumer.stop()


def _outcomes(conn, req_ids, timeout=10.0):
    """Request -> True (finished) or False (failed), as the producer reports them."""
    got, deadline = {}, time.monotonic() + timeout
    while set(req_ids) - set(got) and time.monotonic() < deadline:
        done, failed = conn.get_finished()
        got.update({r: True for r in done})
        got.update({r: False for r in failed})
        time.sleep(0.01)
    assert set(req_ids) <= set(got), f"not reported by the producer within {timeout} s: {got}"
    return got


@pytest.mark.parametrize("case", ["first_chunk", "later_chunk", "control_unchecked"])
def test_a_begin_naming_blocks_the_engine_did_not_give_writes_none_of_them(producer, case):
    conn, caches = producer
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, begin_waits_for_expect_s=2.0,
                               fence_drain_s=0.5, **FAST)
    try:
        peer = conn.add_peer(consumer.info)
        given = {"misrouted": [5, 6], "right": [9, 10]}
        assert consumer.call("expect", list(given), None if case == "control_unchecked" else given) \
            == [True, True]
        if case == "later_chunk":  # its first chunk lands where the engine said
            push_step(conn, caches, [TransferRequest("misrouted", peer, [1], [5], last_chunk=False)])
        # block 7 belongs to no request here: the engine may give it to any other
        push_step(conn, caches, [TransferRequest("misrouted", peer, [2], [7]),
                                 TransferRequest("right", peer, [3, 4], [9, 10])])
        ok = _outcomes(conn, ["misrouted", "right"])
        finished, failed, _ = consumer.call("wait", ["misrouted", "right"], 10.0)
        received = consumer.call("caches")
        written = {b: bool(any((received[layer][b] != UNTOUCHED).any() for layer in range(LAYERS)))
                   for b in (5, 6, 7)}
        assert ok["right"] and "right" in finished
        assert all(np.all(received[layer][[9, 10]] == layer + 1) for layer in range(LAYERS))
        if case == "control_unchecked":
            assert ok["misrouted"] and written[7], "the control: misaddressed bytes land"
            return
        assert not ok["misrouted"] and failed == {"misrouted"}, (ok, finished, failed)
        assert not written[7] and not written[6], "a byte landed in a block the engine did not give"
        assert written[5] == (case == "later_chunk")
        assert consumer.call("stats")["begin_blocks_refused"] == 1
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
        assert producer_outcome(conn, "late")
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
    with pytest.raises(ValueError, match="accept_unsolicited_pushes"):  # no wait means: opt in by name
        ConnectorConfig(begin_waits_for_expect_s=None)

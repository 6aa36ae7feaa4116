"""A consumer that answers the control protocol with malformed, out-of-range, oversized
or foreign values (issue 33): the producer never dies and never raises out of its step
calls; only that consumer's requests fail (or the producer refuses to connect to it),
and a good consumer served in the same steps keeps receiving byte-exact. Real
processes over the real Mooncake engine; the hostile answers are made in the consumer
process (``ConsumerProcess(hostile=...)``, torch_kvops/testing/consumer_process.py):
nine fixed cases, and answers Hypothesis makes up field by field.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import HOSTILE, ConsumerProcess

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 64, (2, 8, 16)  # 1 KiB blocks: fragmented layers are staged
CONFIG = dict(transfer_timeout_s=3.0, max_retries=0, control_timeout_s=2.0, lease_s=10.0,
              fence_drain_s=0.5, staging_slot_bytes=4 << 10, staging_slots=4)
SRC, DST = [0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]  # fragmented: through staging slots
REFUSED_AT_CONNECT = {"grant_huge", "grant_malformed"}


def _push(conn, caches, requests, seed):
    gen = torch.Generator().manual_seed(seed)
    conn.start_step(requests)
    for layer, cache in enumerate(caches):
        cache.copy_(torch.randn(cache.shape, generator=gen))
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=60)


def _outcomes(conn, wanted):
    import time
    finished, failed = set(), set()
    deadline = time.monotonic() + 20
    while not wanted <= finished | failed and time.monotonic() < deadline:
        done, bad = conn.get_finished()
        finished, failed = finished | done, failed | bad
        time.sleep(0.01)
    return finished, failed


@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_a_hostile_consumer_fails_its_own_requests_only(how):
    bad_failed = _serve_beside_a_hostile_consumer(how, refused_at_connect=how in REFUSED_AT_CONNECT)
    assert how in REFUSED_AT_CONNECT or bad_failed >= 1, f"{how}: the hostile consumer's requests must fail"


# What a consumer answers, field by field (control/ and connector/consumer.py)
ANSWER_FIELDS = {"welcome": ["staging", "integrity", "op"], "begun": ["rejected", "grant_s", "op"],
                 "ack": ["slot", "refused", "op"]}
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63), st.floats(allow_nan=True),
    st.text(max_size=12), st.lists(st.integers(-5, 100), max_size=4),
    # foreign ids: the good consumer's requests, named by the hostile one
    st.lists(st.sampled_from(["good-0", "good-1", "bad-0", "bad-1"]), max_size=3),
    st.dictionaries(st.sampled_from(["address", "slots", "slot_bytes", "x"]),
                    st.one_of(st.integers(-1, 1 << 40), st.text(max_size=8)), max_size=3))


@st.composite
def _mutation(draw, op):
    spec = {"op": op, "field": draw(st.sampled_from(ANSWER_FIELDS[op]))}
    if draw(st.booleans()):
        spec["drop"] = True
    else:
        spec["value"] = draw(JUNK)
    return spec


# every begin and staging ack answered with junk in one field; the welcome (which,
# when refused, leaves nothing else to try) now and then
MUTATIONS = st.tuples(_mutation("begun"), _mutation("ack"), st.one_of(st.none(), _mutation("welcome"))
                      ).map(lambda specs: [s for s in specs if s is not None])


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_property_no_consumer_answer_kills_the_producer_or_fails_another_consumer(specs):
    """Hypothesis picks a field of each answer (welcome, begun, ack) and junk for it
    (or drops it): the producer's step calls never raise, and a good consumer in the
    same steps finishes byte-exact; at connect time only a clear refusal is allowed."""
    _serve_beside_a_hostile_consumer(specs, refused_at_connect=None)


def _serve_beside_a_hostile_consumer(how, refused_at_connect) -> int:
    """Two steps pushing to a good consumer and a hostile one; the hostile one's
    failed requests. ``refused_at_connect``: whether the producer must refuse the
    hostile one at ``add_peer`` (None: either, a ValueError if it does)."""
    good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    bad = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, hostile=how, **CONFIG)
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    try:
        conn.register_kv_caches(caches)
        good_peer = conn.add_peer(good.info)
        if refused_at_connect:
            with pytest.raises(ValueError, match="staging grant"):
                conn.add_peer(bad.info)  # refused before it sizes anything here
            bad_peer = None
        elif refused_at_connect is None:
            try:
                bad_peer = conn.add_peer(bad.info)
            except (ValueError, ConnectionError):  # a clear refusal, before anything was sized or sent
                bad_peer = None
        else:
            bad_peer = conn.add_peer(bad.info)
        bad_failed = 0
        for step in range(2):  # the producer goes on after the hostile answers
            good_id, bad_id = f"good-{step}", f"bad-{step}"
            good.call("expect", [good_id])
            requests = [TransferRequest(good_id, good_peer, SRC, DST)]
            if bad_peer is not None:
                bad.call("expect", [bad_id])
                requests.append(TransferRequest(bad_id, bad_peer, SRC, DST))
            _push(conn, caches, requests, seed=step)  # never raises
            finished, failed = _outcomes(conn, {r.req_id for r in requests})
            assert good_id in finished, (how, finished, failed)
            if bad_peer is not None:
                # decided either way (a bad staging ack may come after its step landed)
                assert bad_id in finished | failed, (how, finished, failed)
                bad_failed += bad_id in failed
            # P's report frees its source blocks (staged bytes are already in D's slots);
            # D's report says the bytes are in its blocks: read them after that one
            landed, _, _ = good.call("wait", [good_id], 20.0)
            assert good_id in landed, (how, "the good consumer must report its request finished")
            received = good.call("caches")
            for layer in range(LAYERS):
                assert np.array_equal(received[layer][DST], caches[layer][SRC].numpy()), (how, layer)
        assert conn.stats()["requests_finished"] >= 2
        return bad_failed
    finally:
        conn.close()
        transport.close()
        good.stop()
        bad.stop()

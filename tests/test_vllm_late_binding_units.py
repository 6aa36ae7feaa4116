"""Late binding and kv_transfer_params without an engine: the producer scheduler's
plan for each arrival order of D's destination, its hold bounds, the validation of
every client field, the prefill worker under Model Runner V2's call order (real
Mooncake transfers between two workers in this process), and our classes against the
installed vLLM's base-class signatures."""
import inspect
import time

import types

import pytest
import torch

from torch_kvops.integrations.vllm.metadata import (
    KvopsConnectorMetadata, KvopsSettings, PushReq, RecvReq)
from torch_kvops.integrations.vllm.params import (
    BadTransferParams, decode_params, prefill_params)
from torch_kvops.integrations.vllm.scheduler import ConsumerScheduler, ProducerScheduler

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


class _Request:
    def __init__(self, req_id, params, prompt):
        self.request_id, self.kv_transfer_params = req_id, params
        self.num_prompt_tokens, self.num_computed_tokens = prompt, 0


class _Blocks:
    """vLLM's KVCacheManager as the scheduler uses it: blocks per request, pool size."""

    def __init__(self, ids, pool_blocks=1000):
        self.ids = ids
        self.block_pool = types.SimpleNamespace(num_gpu_blocks=pool_blocks)

    def get_block_ids(self, req_id):
        return (self.ids[req_id],)


class _Out:
    def __init__(self, scheduled=None, preempted=()):
        self.num_scheduled_tokens = scheduled or {}
        self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())
        self.preempted_req_ids = set(preempted)


class _Output:
    def __init__(self, sending=()):
        self.finished_sending = set(sending)


def _post(server, tid, blocks, start=0, answer=b"{"):
    """What D's poster delivers, straight into P's side channel; P's answer starts
    with ``answer``."""
    import json
    import socket
    host, port = server.address.rsplit(":", 1)
    msg = {"transfer_id": tid, "block_ids": blocks, "start_token": start, "peers": [{"engine_id": "d"}]}
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.settimeout(2)
        sock.sendall(json.dumps(msg).encode() + b"\n")
        assert sock.recv(256).startswith(answer)


def _step(sched, scheduled=None):
    meta = KvopsConnectorMetadata()
    sched.build_connector_meta(_Out(scheduled), meta)
    return meta


def _pushes(meta):
    return [(p.src_blocks, p.dst_blocks, p.last_chunk, p.finished) for p in meta.push]


@pytest.fixture
def producer():
    made = []

    def make(**settings):
        sched = ProducerScheduler(KvopsSettings(**dict({"bootstrap_endpoint": False}, **settings)),
                                  block_size=32)
        sched.kv_cache_manager = _Blocks({"r": [10, 11, 12, 13], "s": [14, 15, 16, 17]})
        made.append(sched)
        return sched
    yield make
    for sched in made:
        sched.shutdown()


def test_p_first_is_scheduled_at_once_and_binds_between_chunks(producer):
    sched = producer()
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # never waits for D
    assert _pushes(_step(sched, {"r": 40})) == []  # chunk 1 written, no destination yet
    req.num_computed_tokens = 40
    _post(sched.server, "t", [20, 21, 22, 23])
    # chunk 2: the blocks chunk 1 wrote go with it, at once
    assert _pushes(_step(sched, {"r": 40})) == [([10, 11, 12], [20, 21, 22], False, False)]
    req.num_computed_tokens = 80
    assert _pushes(_step(sched, {"r": 20})) == [([12, 13], [22, 23], True, False)]
    held, params = sched.request_finished(req)
    assert held and params["transfer_id"] == "t"  # freed once the push ended
    sched.update_connector_output(_Output({"r"}))
    assert not sched.has_pending_push_work()


def test_p_owes_a_transfer_from_its_post_until_the_workers_report_it_pushed(producer):
    """What P answers D's liveness question (side_channel/server.py) through a
    request's life: queued (posted, not admitted), prefilling, last chunk handed over
    and finished (the pushes may still run), reported pushed by the workers."""
    sched = producer()
    _post(sched.server, "t", [20, 21, 22, 23])
    assert sched.server.pending(["t", "other"]) == ["t"]  # waits in P's queue
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    sched.get_num_new_matched_tokens(req, 0)  # admitted: the destination is taken
    _step(sched, {"r": 40})
    req.num_computed_tokens = 40
    assert sched.server.pending(["t"]) == ["t"]  # prefilling: more chunks to come
    assert _pushes(_step(sched, {"r": 60}))[-1][2] is True  # the last chunk
    req.num_computed_tokens = 100
    assert sched.request_finished(req)[0] is True
    assert sched.server.pending(["t"]) == ["t"]  # its pushes may still run
    sched.update_connector_output(_Output({"r"}))
    assert sched.server.pending(["t"]) == []


def test_a_decode_block_named_again_ends_the_stale_push_not_the_new_one(producer):
    """D reused block 22 (the request that had it ended on D) for a new request while
    P still pushes the old one in chunks: P stops the stale push and the new one goes
    out alone, so no step names a decode block twice (which would fail both)."""
    sched = producer()
    old = _Request("r", {"do_remote_decode": True, "transfer_id": "tr"}, prompt=100)
    new = _Request("s", {"do_remote_decode": True, "transfer_id": "ts"}, prompt=100)
    _post(sched.server, "tr", [20, 21, 22, 23])
    sched.get_num_new_matched_tokens(old, 0)
    assert _pushes(_step(sched, {"r": 40})) == [([10, 11], [20, 21], False, False)]
    old.num_computed_tokens = 40
    _post(sched.server, "ts", [22, 30, 31, 32])
    sched.get_num_new_matched_tokens(new, 0)
    pushes = _pushes(_step(sched, {"r": 60, "s": 100}))
    assert pushes == [([14, 15, 16, 17], [22, 30, 31, 32], True, False)], pushes
    assert sched.connector_stats().data["failed_stale_destination"] == 1


def test_a_request_aborted_before_admission_is_owed_no_more(producer):
    sched = producer()
    _post(sched.server, "t", [20, 21, 22, 23])
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    assert sched.request_finished(req) == (False, None)  # aborted in vLLM's waiting queue
    assert sched.server.pending(["t"]) == []
    _post(sched.server, "t", [20, 21, 22, 23], answer=b"settled")


def test_destination_after_finish_pushes_the_held_blocks_in_a_step_without_tokens(producer):
    sched = producer()
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    sched.get_num_new_matched_tokens(req, 0)
    _step(sched, {"r": 100})
    req.num_computed_tokens = 100
    assert sched.request_finished(req)[0] is True  # held for its destination
    assert sched.held == 1 and sched.has_pending_push_work()
    assert _pushes(_step(sched)) == []
    _post(sched.server, "t", [20, 21, 22, 23], start=32)  # D had block 0 cached
    meta = _step(sched)
    assert _pushes(meta) == [([11, 12, 13], [21, 22, 23], True, True)] and meta.release == []
    assert sched.held == 0 and sched.has_pending_push_work()
    sched.update_connector_output(_Output({"r"}))
    assert not sched.has_pending_push_work()
    stats = sched.connector_stats().data
    assert stats["holds"] == 1 and stats["holds_pushed"] == 1 and "held_change" not in stats


def test_holds_are_released_on_their_time_bound_once(producer):
    sched = producer(hold_for_decode_s=0.1)
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    sched.get_num_new_matched_tokens(req, 0)
    req.num_computed_tokens = 100
    assert sched.request_finished(req)[0] is True
    assert _step(sched).release == []
    time.sleep(0.15)
    assert _step(sched).release == ["r"]
    assert _step(sched).release == []  # released once
    assert sched.has_pending_push_work()  # until the workers report it
    # too late: refused (D recomputes at once) and never pending again
    _post(sched.server, "t", [20, 21, 22, 23], answer=b"settled")
    assert sched.server.pending(["t"]) == []
    assert _pushes(_step(sched)) == []
    sched.update_connector_output(_Output({"r"}))
    assert not sched.has_pending_push_work()
    assert sched.connector_stats().data["failed_hold_expired"] == 1


@pytest.mark.parametrize("bound,cause", [({"max_held_requests": 1}, "hold_overflow"),
                                         ({"max_held_pool_share": 0.5}, "hold_pool_share")])
def test_holds_are_released_oldest_first_over_their_count_or_pool_share_bound(producer, bound, cause):
    """Two 4-block holds: over a count bound of one, or in a 12-block pool with a share
    of one half (8 blocks held, over 6), the oldest goes at once; the one left is bound
    and pushed when its destination comes."""
    sched = producer(**bound)
    sched.kv_cache_manager.block_pool.num_gpu_blocks = 12
    for rid in ("r", "s"):
        req = _Request(rid, {"do_remote_decode": True, "transfer_id": "t" + rid}, prompt=100)
        sched.get_num_new_matched_tokens(req, 0)
        req.num_computed_tokens = 100
        assert sched.request_finished(req)[0] is True
    assert _step(sched).release == ["r"] and sched.held == 1
    assert sched.connector_stats().data["failed_" + cause] == 1
    _post(sched.server, "ts", [20, 21, 22, 23])
    assert _pushes(_step(sched)) == [([14, 15, 16, 17], [20, 21, 22, 23], True, True)]


def test_no_hold_without_late_binding_or_for_an_unfinished_prefill(producer):
    sched = producer(late_binding=False, wait_for_decode_s=0.05)
    req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # D-first: wait
    time.sleep(0.1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    req.num_computed_tokens = 100
    assert sched.request_finished(req) == (False, None)
    late = producer()
    aborted = _Request("s", {"do_remote_decode": True, "transfer_id": "u"}, prompt=100)
    late.get_num_new_matched_tokens(aborted, 0)
    aborted.num_computed_tokens = 40  # aborted mid-prefill: D could not use it
    assert late.request_finished(aborted)[0] is False


@pytest.mark.parametrize("params, field", [
    ({"do_remote_decode": True}, "transfer_id is missing"),
    ({"do_remote_decode": True, "transfer_id": 3}, "transfer_id must be a string"),
    ({"do_remote_decode": True, "transfer_id": "a|b"}, "transfer_id"),
    ({"do_remote_decode": True, "transfer_id": "x" * 257}, "longer than"),
    ({"do_remote_decode": "true", "transfer_id": "t"}, "do_remote_decode must be"),
    ({"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"}, "both true"),
    ({"do_remote_decode": True, "transfer_id": "t", "kvops_push_mode": "soon"}, "kvops_push_mode"),
    (["do_remote_decode"], "must be an object"),
])
def test_prefill_params_refuse_each_malformed_field(params, field):
    with pytest.raises(BadTransferParams, match=field):
        prefill_params(params)


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": True, "kvops_producer": "h:1"}, "transfer_id is missing"),
    ({"do_remote_prefill": True, "transfer_id": "", "kvops_producer": "h:1"}, "transfer_id"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "nocolon"}, "host:port"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "h:x"}, "port"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "h:70000"}, "port"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "a b:1"}, "bad host"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": ["h", 1]}, "must be a string"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "h" * 300 + ":1"}, "longer"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "h:8998"}, "http://"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "http://h"}, "host:port"),
    ({"do_remote_prefill": True, "transfer_id": "t"}, "needs kvops_producer"),
    ({"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "h:1",
      "remote_engine_id": 5}, "remote_engine_id must be a string"),
    ({"do_remote_prefill": 1, "transfer_id": "t", "kvops_producer": "h:1"}, "do_remote_prefill must be"),
])
def test_decode_params_refuse_each_malformed_field(params, field):
    with pytest.raises(BadTransferParams, match=field):
        decode_params(params)


def test_both_router_dialects_are_accepted():
    assert prefill_params(None) is None and decode_params({"do_remote_prefill": False}) is None
    p = prefill_params({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-9a"})
    assert (p.transfer_id, p.push_mode) == ("xfer-9a", None)
    d = decode_params({"do_remote_prefill": True, "transfer_id": "xfer-9a",
                       "remote_bootstrap_addr": "http://10.0.0.2:8998", "remote_engine_id": "e1"})
    assert (d.producer, d.remote_engine_id) == ("http://10.0.0.2:8998", "e1")  # forwarded as given
    assert decode_params({"do_remote_prefill": True, "transfer_id": "t",
                          "kvops_producer": "[::1]:5"}).producer == "[::1]:5"


def test_bad_params_cost_their_request_only_on_both_schedulers(producer):
    sched = producer()
    bad = _Request("r", {"do_remote_decode": True, "transfer_id": 5}, prompt=64)
    assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)  # prefilled, no push
    assert sched.request_finished(bad) == (False, None)
    assert sched.connector_stats().data["failed_bad_transfer_params"] == 1
    d = ConsumerScheduler(KvopsSettings(), block_size=32)
    try:
        req = _Request("x", {"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "nocolon"}, 64)
        assert d.get_num_new_matched_tokens(req, 0) == (0, False)
        d.update_state_after_alloc(req, None, 0)
        d.build_connector_meta(_Out({"x": 64}), KvopsConnectorMetadata())
        held, params = d.request_finished(req)
        assert not held and params["kvops_local_prompt_tokens"] == 64
        assert "host:port" in params["kvops_error"]
        assert d.connector_stats().data["failed_bad_transfer_params"] == 1
    finally:
        d.shutdown()


def test_decode_refuses_a_second_live_request_with_a_transfer_id_in_use():
    """Two live requests with one transfer id would share one posting: one would never
    get its KV and, aborted, never free its blocks. The second computes its prompt
    locally and says why; once the first finished, the id may be used again."""
    d = ConsumerScheduler(KvopsSettings(), block_size=32)
    params = {"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": "127.0.0.1:1"}
    try:
        first, second = _Request("a", params, 64), _Request("b", dict(params), 64)
        assert d.get_num_new_matched_tokens(first, 0) == (64, True)
        assert d.get_num_new_matched_tokens(first, 0) == (64, True)  # asked again: still its own
        assert d.get_num_new_matched_tokens(second, 0) == (0, False)
        held, out = d.request_finished(second)
        assert not held and "used by another live request" in out["kvops_error"]
        d.request_finished(first)
        third = _Request("c", dict(params), 64)
        assert d.get_num_new_matched_tokens(third, 0) == (64, True)
        d.request_finished(third)
    finally:
        d.shutdown()


def test_the_step_bounds_of_the_worker_and_the_sender_agree():
    """The sender fails a step that outlives step_timeout_s (its requests alone);
    wait_for_save waits longer than that plus a write under way, so a slow decode side
    never makes it raise into vLLM (issue 33)."""
    s = KvopsSettings(step_timeout_s=7.0, connector={"transfer_timeout_s": 2.0, "max_retries": 1})
    assert s.connector_config().step_timeout_s == 7.0
    assert s.save_wait_s() > 7.0 + 2 * 2.0
    own = KvopsSettings(step_timeout_s=7.0, connector={"step_timeout_s": 3.0})
    assert own.connector_config().step_timeout_s == 3.0  # the connector's own setting wins


def test_settings_accept_vllm_mooncake_keys_and_refuse_bad_bounds():
    s = KvopsSettings.from_extra({"bootstrap_server_address": "10.0.0.1:8998", "late_binding": False,
                                  "wait_for_decode_s": 5})
    assert not s.late_binding and s.bootstrap_server_address == "10.0.0.1:8998"
    for bad in ({"hold_for_decode_s": 0}, {"max_held_requests": -1}, {"late_binding": "no"}):
        with pytest.raises(ValueError):
            KvopsSettings.from_extra(bad)


# ---------------------------------------------------------------------- prefill worker

def _caches(layers=2, blocks=8, fill=True):
    gen = torch.Generator().manual_seed(3)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(blocks, 2, 16, 64, generator=gen)
                                                 if fill else torch.zeros(blocks, 2, 16, 64))
            for i in range(layers)}


@pytest.fixture
def workers():
    from torch_kvops.integrations.vllm.worker_consumer import ConsumerWorker
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker

    settings = KvopsSettings(connector={"quarantine_s": 0.05}, step_timeout_s=20)
    p, d = ProducerWorker(settings, 8, total_kv_heads=2), ConsumerWorker(settings, 8, total_kv_heads=2)
    p_kv, d_kv = _caches(), _caches(fill=False)
    try:
        p.register_kv_caches(p_kv)
        d.register_kv_caches(d_kv)
        yield p, d, p_kv, d_kv
    finally:
        p.close()
        d.close()


def _until(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def _recv(d, req_id, tid, blocks):
    meta = KvopsConnectorMetadata()
    meta.recv.append(RecvReq(req_id, tid, 1, blocks))
    d.begin_step(meta)


def test_a_held_request_is_pushed_without_a_forward(workers):
    """A step with no forward (vLLM's kv_connector_no_forward): wait_for_save pushes
    every layer; the request is reported free once, after the push landed."""
    p, d, p_kv, d_kv = workers
    _recv(d, "r", "t", [5, 6])
    meta = KvopsConnectorMetadata()
    meta.push.append(PushReq("r", "t", [d.peer_info()], [1, 2], [5, 6], True, "layerwise", finished=True))
    p.begin_step(meta)
    assert p.get_finished(set())[0] == set()  # Model Runner V2: before wait_for_save
    p.wait_for_save()  # no save_kv_layer was called: every layer goes now
    assert _until(lambda: p.get_finished(set())[0]) == {"r"}
    assert _until(lambda: d.get_finished(set())[1]) == {"r"}
    for name in p_kv:
        assert torch.equal(d_kv[name][5:7], p_kv[name][1:3])
    assert p.get_finished(set())[0] == set()  # once


def test_a_transfer_id_used_again_on_a_decode_rank_recomputes_instead_of_hanging(workers):
    """A request whose transfer id this rank already used (its part was reported) can
    never be reported again: it fails at once (recompute), and a push for it is refused."""
    p, d, p_kv, d_kv = workers
    _recv(d, "r1", "t", [5, 6])
    meta = KvopsConnectorMetadata()
    meta.push.append(PushReq("r1", "t", [d.peer_info()], [1, 2], [5, 6], True, "layerwise", finished=True))
    p.begin_step(meta)
    p.wait_for_save()
    assert _until(lambda: d.get_finished(set())[1]) == {"r1"}
    _recv(d, "r2", "t", [3, 4])  # the same transfer id again
    recving, failed = set(), set()
    for _ in range(3):
        _, got, bad = d.get_finished(set())
        recving, failed = recving | got, failed | bad
    assert recving == failed == {"r2"}  # at once, not at a lease's end
    before = [d_kv[name][3:5].clone() for name in d_kv]
    again = KvopsConnectorMetadata()
    again.push.append(PushReq("r2", "t", [d.peer_info()], [1, 2], [3, 4], True, "layerwise", finished=True))
    p.begin_step(again)
    p.wait_for_save()
    _until(lambda: p.get_finished(set())[0] or True)
    for name, old in zip(d_kv, before):
        assert torch.equal(d_kv[name][3:5], old), "nothing may land for a reused id"


def test_a_broken_link_to_a_decode_instance_is_connected_again_after_its_backoff():
    """A transient failure does not cut P from D for good (issue 33): the control
    connection is killed (as a network fault would, ``ss -K``); the next push to that D
    fails, the link is connected again after the breaker's backoff, and pushes land
    again."""
    import subprocess

    from torch_kvops.integrations.vllm.worker_consumer import ConsumerWorker
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker

    settings = KvopsSettings(connector={"quarantine_s": 0.05, "lease_s": 2.0, "fence_drain_s": 0.5},
                             step_timeout_s=20)
    p, d = ProducerWorker(settings, 8, total_kv_heads=2), ConsumerWorker(settings, 8, total_kv_heads=2)
    p_kv, d_kv = _caches(), _caches(fill=False)
    try:
        p.register_kv_caches(p_kv)
        d.register_kv_caches(d_kv)
        _reconnects(p, d, p_kv, d_kv)
    finally:
        p.close()
        d.close()


def _reconnects(p, d, p_kv, d_kv):
    import subprocess

    def push(req_id, src, dst):
        _recv(d, req_id, "t" + req_id, dst)
        meta = KvopsConnectorMetadata()
        meta.push.append(PushReq(req_id, "t" + req_id, [d.peer_info()], src, dst, True, "layerwise",
                                 finished=True))
        p.begin_step(meta)
        p.wait_for_save()
        p.get_finished(set())
        recving, failed, deadline = set(), set(), time.monotonic() + 30
        while req_id not in recving:
            assert time.monotonic() < deadline, f"D never ended {req_id}"
            _, got, bad = d.get_finished(set())
            recving, failed = recving | got, failed | bad
            time.sleep(0.01)
        return req_id not in failed

    assert push("a", [1], [5])
    port = d.peer_info()["control_address"].rsplit(":", 1)[1]
    subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], check=True, timeout=10)
    assert not push("b", [2], [6])  # the cut is found at this push: it fails, D recomputes
    deadline, attempt = time.monotonic() + 30, 0
    while True:
        time.sleep(0.3)  # the breaker's first backoff is at most 0.5 s
        attempt += 1
        if push(f"c{attempt}", [3], [7]):
            break
        assert time.monotonic() < deadline, "the link was never connected again"
    for name in p_kv:
        assert torch.equal(d_kv[name][7], p_kv[name][3])
    assert p.metrics.take(lambda: {}).data.get("peer_reconnected", 0) >= 1


def test_get_finished_before_wait_for_save_defers_aborts_and_frees(workers):
    """Model Runner V2 collects get_finished before wait_for_save: a request finished
    before its last chunk is aborted, and its blocks freed, only after the step."""
    p, d, p_kv, d_kv = workers
    _recv(d, "a", "ta", [3, 4])
    _recv(d, "b", "tb", [5, 6])
    first = KvopsConnectorMetadata()
    first.push.append(PushReq("a", "ta", [d.peer_info()], [1], [3], False, "layerwise"))
    p.begin_step(first)
    for name in p_kv:
        p.save_kv_layer(name)
    p.wait_for_save()
    p.get_finished(set())
    second = KvopsConnectorMetadata()
    second.push.append(PushReq("b", "tb", [d.peer_info()], [6, 7], [5, 6], True, "layerwise"))
    second.release.append("h")  # a hold the scheduler gave up: reported free once
    p.begin_step(second)
    # "a" finished by the scheduler while "b"'s step runs: no abort mid-step (it raised)
    freed = p.get_finished({"a"})[0]
    assert freed <= {"h"}  # never pushed: free at any time
    for name in p_kv:
        p.save_kv_layer(name)
    p.wait_for_save()
    time.sleep(0.06)  # the quarantine of an aborted request's blocks
    freed |= p.get_finished({"b"})[0]  # the scheduler finished b after its last chunk
    for _ in range(100):
        freed |= p.get_finished(set())[0]
        if {"a", "b", "h"} <= freed:
            break
        time.sleep(0.02)
    assert freed == {"a", "b", "h"}
    ended = set()  # D heard of a's abort at once (not at its lease's end) and got b
    deadline = time.monotonic() + 10
    while not ended >= {"a", "b"} and time.monotonic() < deadline:
        ended |= d.get_finished(set())[1]
        time.sleep(0.01)
    assert ended == {"a", "b"}
    assert 3 not in d.get_block_ids_with_load_errors()  # a's landed chunk is kept


# ---------------------------------------------------------------------- vLLM's base classes

def _own_overrides(cls, base):
    for name, member in vars(cls).items():
        if name.startswith("_") or not callable(getattr(base, name, None)):
            continue
        yield name, member


def _params(fn):
    fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    return [(p.name, p.kind, p.default is inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def test_our_overrides_take_the_installed_vllm_base_parameters():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_offload.base import OffloadingWorker
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from torch_kvops.integrations.vllm.connector import KvopsLayerwiseConnector
    from torch_kvops.integrations.vllm.offload.spec import KvopsOffloadingSpec
    from torch_kvops.integrations.vllm.offload.worker import KvopsOffloadingWorker

    checked = 0
    for cls, base in ((KvopsLayerwiseConnector, KVConnectorBase_V1),
                      (KvopsOffloadingWorker, OffloadingWorker),
                      (KvopsOffloadingSpec, CPUOffloadingSpec)):
        for name, member in _own_overrides(cls, base):
            ours, theirs = _params(member), _params(vars_of(base, name))
            # every base parameter, in order, with the same kind; we may add optional ones
            assert ours[:len(theirs)] == theirs, (cls.__name__, name, ours, theirs)
            assert all(not required for _, _, required in ours[len(theirs):]), (cls.__name__, name)
            checked += 1
    assert checked >= 20
    params = [p for p, _, _ in _params(KvopsOffloadingWorker.submit_load)]
    assert params[-1] == "expedited"  # vLLM 0.33 passes it
    assert KvopsLayerwiseConnector.supports_sleep_mode() is False


def vars_of(base, name):
    for klass in base.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def test_an_unusable_destination_fails_its_request_alone(workers):
    """A destination from the side channel whose peers the worker cannot use (here
    without an engine id) is not pushed; the request is freed, the next one pushes."""
    p, d, p_kv, d_kv = workers
    meta = KvopsConnectorMetadata()
    meta.push.append(PushReq("x", "tx", [{"nonsense": 1}], [1], [2], True, "layerwise", finished=True))
    p.begin_step(meta)  # does not raise into the engine
    p.wait_for_save()
    assert p.get_finished(set())[0] == {"x"}
    assert p.metrics.take(p.conn.stats).data["failed_bad_destination"] == 1
    _recv(d, "r", "t", [5])
    good = KvopsConnectorMetadata()
    good.push.append(PushReq("r", "t", [d.peer_info()], [1], [5], True, "layerwise", finished=True))
    p.begin_step(good)
    p.wait_for_save()
    assert _until(lambda: p.get_finished(set())[0]) == {"r"}


def test_a_refused_step_fails_its_parts_instead_of_the_engine():
    """The connector refuses a step's plan (e.g. two requests naming one destination
    block after D reused it): P's worker fails those parts and keeps running."""
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker
    from torch_kvops.plan import TransferRequest

    class _Conn:
        def __init__(self):
            self.aborted = []

        def start_step(self, requests):
            raise ValueError("destination block 8 is named twice")

        def abort(self, tid, reason):
            self.aborted.append(tid)
            return tid == "a|p0d0"  # in flight: its failure comes back through get_finished

    class _Metrics:
        def __init__(self):
            self.counts = {}

        def count(self, key, n=1):
            self.counts[key] = self.counts.get(key, 0) + n

    worker = ProducerWorker.__new__(ProducerWorker)
    worker.conn, worker.metrics = _Conn(), _Metrics()
    worker._tid_to_req = {"a|p0d0": "a", "b|p0d0": "b"}
    worker._parts = {"a": {"a|p0d0"}, "b": {"b|p0d0"}}
    worker._outcome = set()
    parts = [TransferRequest("a|p0d0", "peer", [1], [8]), TransferRequest("b|p0d0", "peer", [2], [8])]
    worker._refuse_step(parts, ValueError("destination block 8 is named twice"))
    assert worker.conn.aborted == ["a|p0d0", "b|p0d0"]
    assert worker._parts == {"a": {"a|p0d0"}}  # waits for its reported failure
    assert worker._outcome == {"b"}  # never started: ended now, its blocks may be freed
    assert worker.metrics.counts == {"failed_refused_step": 2}


def test_the_peer_breaker_backs_off_doubling_with_jitter_up_to_its_cap():
    from torch_kvops.connector.breaker import PeerBreaker

    now = [0.0]
    breaker = PeerBreaker(base_s=0.5, cap_s=4.0, clock=lambda: now[0])
    assert breaker.may_try("d")
    backoffs = [breaker.failed("d", "unreachable") for _ in range(6)]
    for i, b in enumerate(backoffs):
        full = min(4.0, 0.5 * 2 ** i)
        assert full / 2 <= b <= full, (i, b)
    assert not breaker.may_try("d")
    now[0] += backoffs[-1]
    assert breaker.may_try("d") and breaker.states()["d"]["failures"] == 6
    breaker.closed("d")
    assert breaker.states() == {} and breaker.may_try("d")
    # a peer nobody asks for any more (gone for good) is forgotten after idle_s
    breaker.failed("gone", "unreachable")
    now[0] += 11.0  # its next attempt was due 10.5 s ago at least, and not made
    breaker.failed("fresh", "unreachable")
    breaker.forget_stale(idle_s=10.0)
    assert set(breaker.states()) == {"fresh"}

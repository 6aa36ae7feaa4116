"""Pieces of the vLLM integration that need no engine: cache layouts, the decode ->
prefill side channel (real sockets on loopback), settings."""
import json
import socket
import time

import types

import pytest
import torch

from torch_kvops.integrations.vllm.metadata import KvopsSettings
from torch_kvops.integrations.vllm.side_channel import DestinationPoster, DestinationServer
from torch_kvops.integrations.vllm.worker import block_views

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


def test_block_views_accept_block_major_and_kv_plane_layouts():
    cpu = torch.zeros(10, 4, 32, 128)  # vLLM CPU backend: [blocks, kv_heads, block, 2*head]
    assert [v.shape for v in block_views("l0", cpu, 10)] == [cpu.shape]
    (by_head,) = block_views("l0", cpu, 10, local_heads=4)  # one unit per head of a block
    assert by_head.shape == (40, 32, 128) and by_head.data_ptr() == cpu.data_ptr()
    planes = torch.zeros(2, 10, 32, 4, 64)  # [K/V, blocks, ...]
    k, v = block_views("l0", planes, 10)
    assert k.shape == (10, 32, 4, 64) and v.data_ptr() == planes[1].data_ptr()


@pytest.mark.parametrize("cache", [torch.zeros(4, 10, 8),  # blocks not on dim 0 or 1
                                   torch.zeros(8, 10, 4).permute(1, 0, 2)])  # strided blocks
def test_block_views_reject_other_layouts_clearly(cache):
    with pytest.raises(ValueError, match="unsupported layout"):
        block_views("model.layers.0.attn", cache, 10)


class _Results(list):
    def __call__(self, tid, answer):
        self.append((tid, answer))

    def wait(self, n=1, timeout=5.0):
        deadline = time.monotonic() + timeout
        while len(self) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self)


def test_destination_posted_by_decode_is_taken_once_by_prefill():
    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 2})
    results = _Results()
    poster = DestinationPoster(results, timeout_s=1.0, retries=0)
    try:
        poster.post(server.address, {"transfer_id": "t1", "block_ids": [4, 5], "start_token": 0,
                                     "peers": [{"engine_id": "d"}]})
        assert results.wait() == [("t1", {"ok": True, "prefill_tp": 2})]
        assert server.take("t1") == {"block_ids": [4, 5], "start_token": 0, "peers": [{"engine_id": "d"}]}
        assert server.take("t1") is None
        assert poster.failures == 0
    finally:
        poster.close()
        server.close()


def _ask(address, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.settimeout(2)
        sock.sendall(payload)
        return sock.recv(64).strip()


def test_side_channel_is_bounded_and_refuses_malformed_messages():
    server = DestinationServer("127.0.0.1", 0, capacity=2)
    try:
        msg = {"block_ids": [1], "start_token": 0, "peers": [{}]}
        assert _ask(server.address, b"not json\n") == b"bad"
        assert _ask(server.address, json.dumps({"transfer_id": "x"}).encode() + b"\n") == b"bad"
        assert _ask(server.address, json.dumps(dict(msg, transfer_id="x", peers=[])).encode() + b"\n") == b"bad"
        ok = b'{"ok": true}'
        for tid, answer in [("a", ok), ("b", ok), ("c", b"full")]:
            assert _ask(server.address, json.dumps(dict(msg, transfer_id=tid)).encode() + b"\n") == answer
        assert server.take("c") is None and server.take("a") is not None
    finally:
        server.close()


def test_posting_to_a_dead_prefill_side_gives_up_within_its_bound():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = _Results()
    poster = DestinationPoster(results, timeout_s=0.5, retries=2)
    try:
        start = time.monotonic()
        poster.post(f"127.0.0.1:{port}", {"transfer_id": "t"})
        assert results.wait(timeout=10) == [("t", None)]  # the decode side fails the request
        assert poster.failures == 1
        assert time.monotonic() - start < 3 * 0.5 + 1.0
    finally:
        poster.close()


def test_settings_reject_unknown_keys_and_modes():
    assert KvopsSettings.from_extra({"push_mode": "after_forward"}).push_mode == "after_forward"
    with pytest.raises(ValueError, match="unknown"):
        KvopsSettings.from_extra({"pushmode": "layerwise"})
    with pytest.raises(ValueError, match="push_mode"):
        KvopsSettings.from_extra({"push_mode": "eventually"})
    with pytest.raises(TypeError):
        KvopsSettings.from_extra({"connector": {"no_such_field": 1}})


def test_the_transport_protocol_and_devices_reach_the_engine():
    """MooncakeConnector's ``mooncake_protocol`` is taken as ``protocol``; what the
    settings say reaches Mooncake: RDMA on this host, which has no RDMA device, stops
    the worker at start-up with the reason (Mooncake alone would fall back to TCP)."""
    import os

    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker
    from torch_kvops.transports import TransportError

    settings = KvopsSettings.from_extra({"mooncake_protocol": "rdma", "device_name": "mlx5_0"})
    assert (settings.protocol, settings.device_name) == ("rdma", "mlx5_0")
    assert KvopsSettings.from_extra({}).protocol == "tcp"
    with pytest.raises(ValueError, match="disagree"):
        KvopsSettings.from_extra({"mooncake_protocol": "rdma", "protocol": "tcp"})
    with pytest.raises(ValueError, match="protocol must be"):
        KvopsSettings.from_extra({"protocol": "carrier-pigeon"})
    assert not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")), \
        "this test expects a host without RDMA devices"
    with pytest.raises(TransportError, match="no RDMA device"):
        ProducerWorker(settings, num_blocks=4)
    ProducerWorker(KvopsSettings.from_extra({"protocol": "tcp"}), num_blocks=4).close()


class _Request:
    """The fields of vllm.v1.request.Request the scheduler side reads."""

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
    def __init__(self, scheduled, preempted=()):
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = sum(scheduled.values())
        self.preempted_req_ids = set(preempted)


def _wait_for_destination(sched, req, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sched.get_num_new_matched_tokens(req, 0) == (0, False):
            return
        time.sleep(0.01)
    raise AssertionError("destination never arrived")


def test_prefill_scheduler_waits_for_its_destination_then_pushes_each_chunk():
    """Late binding off (the D-first protocol)."""
    from torch_kvops.integrations.vllm.metadata import KvopsConnectorMetadata
    from torch_kvops.integrations.vllm.scheduler import ProducerScheduler

    sched = ProducerScheduler(KvopsSettings(late_binding=False, wait_for_decode_s=30,
                                            bootstrap_endpoint=False), block_size=32)
    poster = DestinationPoster(_Results(), timeout_s=1.0, retries=0)
    try:
        sched.kv_cache_manager = _Blocks({"r": [10, 11, 12, 13]})
        req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not yet: ask later
        poster.post(sched.server.address, {"transfer_id": "t", "block_ids": [20, 21, 22, 23],
                                           "start_token": 0, "peers": [{"engine_id": "d"}]})
        _wait_for_destination(sched, req)
        pushes = []
        for computed, scheduled in [(0, 40), (40, 40), (80, 20), (100, 1)]:  # 3 chunks + decode
            req.num_computed_tokens = computed
            meta = KvopsConnectorMetadata()
            sched.build_connector_meta(_Out({"r": scheduled}), meta)
            pushes.append([(p.src_blocks, p.dst_blocks, p.last_chunk) for p in meta.push])
        # a block cut by a chunk boundary (block 1 at token 40) goes again, whole
        assert pushes == [[([10, 11], [20, 21], False)], [([11, 12], [21, 22], False)],
                          [([12, 13], [22, 23], True)], []]
        held, params = sched.request_finished(req)
        assert held  # blocks held for the push
        assert params == {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t",
                          "kvops_producer": sched.server.address}
        assert sched.has_pending_push_work()

        class _Output:
            finished_sending = {"r"}
        sched.update_connector_output(_Output())
        assert not sched.has_pending_push_work()
    finally:
        poster.close()
        sched.shutdown()


def test_a_preempted_prefill_pushes_again_from_the_start_with_its_recompute():
    from torch_kvops.integrations.vllm.metadata import KvopsConnectorMetadata
    from torch_kvops.integrations.vllm.scheduler import ProducerScheduler

    sched = ProducerScheduler(KvopsSettings(late_binding=False, wait_for_decode_s=30,
                                            bootstrap_endpoint=False), block_size=32)
    poster = DestinationPoster(_Results(), timeout_s=1.0, retries=0)
    try:
        blocks = _Blocks({"r": [10, 11, 12, 13]})
        sched.kv_cache_manager = blocks
        req = _Request("r", {"do_remote_decode": True, "transfer_id": "t"}, prompt=100)
        sched.get_num_new_matched_tokens(req, 0)
        # D's first block is a local prefix-cache hit there: P pushes from token 32
        poster.post(sched.server.address, {"transfer_id": "t", "block_ids": [20, 21, 22, 23],
                                           "start_token": 32, "peers": [{"engine_id": "d"}]})
        _wait_for_destination(sched, req)

        def step(computed, scheduled, preempted=()):
            req.num_computed_tokens = computed
            meta = KvopsConnectorMetadata()
            sched.build_connector_meta(_Out(scheduled, preempted), meta)
            return [(p.src_blocks, p.dst_blocks, p.last_chunk) for p in meta.push]

        assert step(0, {"r": 70}) == [([11, 12], [21, 22], False)]
        assert step(0, {}, preempted={"r"}) == []  # freed; back in the waiting queue
        blocks.ids["r"] = [30, 31, 32, 33]  # recomputed in other blocks
        assert step(0, {"r": 60}) == [([31], [21], False)]
        assert step(60, {"r": 40}) == [([31, 32, 33], [21, 22, 23], True)]
        assert sched.connector_stats().data["preempted_repushes"] == 1
        # preempted after its last chunk: D has it all, nothing is pushed again
        assert step(0, {}, preempted={"r"}) == [] and step(0, {"r": 100}) == []
    finally:
        poster.close()
        sched.shutdown()


def test_prefill_scheduler_gives_up_waiting_within_its_bound():
    from torch_kvops.integrations.vllm.scheduler import ProducerScheduler

    sched = ProducerScheduler(KvopsSettings(late_binding=False, wait_for_decode_s=0.2,
                                            bootstrap_endpoint=False), block_size=32)
    try:
        req = _Request("r", {"do_remote_decode": True, "transfer_id": "never"}, prompt=64)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.3)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # prefill, no push
        assert sched.request_finished(req) == (False, None)  # nothing pushed: free at once
    finally:
        sched.shutdown()


def test_decode_scheduler_claims_the_prompt_posts_its_blocks_and_counts_local_tokens():
    from torch_kvops.integrations.vllm.metadata import KvopsConnectorMetadata
    from torch_kvops.integrations.vllm.scheduler import ConsumerScheduler

    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 2})
    sched = ConsumerScheduler(KvopsSettings(), block_size=32)
    try:
        sched.peers = [{"engine_id": "d0"}, {"engine_id": "d1"}]
        sched.kv_cache_manager = _Blocks({"r": [7, 8, 9, 3]})
        params = {"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": server.address}
        req = _Request("r", params, prompt=100)
        assert sched.get_num_new_matched_tokens(req, 0) == (100, True)
        sched.update_state_after_alloc(req, None, 100)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # one transfer per request
        # the workers hear of the request once P accepted it (P's answer names its TP size)
        recv = []
        deadline = time.monotonic() + 5
        while not recv and time.monotonic() < deadline:
            meta = KvopsConnectorMetadata()
            sched.build_connector_meta(_Out({}), meta)
            recv = meta.recv
            time.sleep(0.01)
        assert [(r.req_id, r.transfer_id, r.prefill_tp) for r in recv] == [("r", "t", 2)]
        assert server.take("t") == {"block_ids": [7, 8, 9, 3], "start_token": 0,
                                    "peers": [{"engine_id": "d0"}, {"engine_id": "d1"}]}

        class _Output:
            finished_recving = {"r"}
        sched.update_connector_output(_Output())
        # vLLM recomputes the last prompt token, then decodes
        for computed, scheduled in [(99, 1), (100, 1)]:
            req.num_computed_tokens = computed
            sched.build_connector_meta(_Out({"r": scheduled}), KvopsConnectorMetadata())
        assert sched.request_finished(req) == (False, {"kvops_local_prompt_tokens": 1})
    finally:
        sched.shutdown()
        server.close()


def test_decode_scheduler_renews_what_p_still_owes_until_its_request_is_aborted():
    """D asks P which transfers it still owes (every lease_s/6) and hands the workers
    those requests to renew; an aborted request is never renewed again (its lease then
    frees its blocks), and a transfer P settled is not renewed. No wall-clock window:
    renewals are collected until they are there, and "never again" is checked over
    questions P answered after the abort, counted (30 s bounds are failure bounds)."""
    from torch_kvops.integrations.vllm.metadata import KvopsConnectorMetadata
    from torch_kvops.integrations.vllm.scheduler import ConsumerScheduler

    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 1})
    sched = ConsumerScheduler(KvopsSettings(connector={"lease_s": 0.3}), block_size=32)

    def step():
        meta = KvopsConnectorMetadata()
        sched.build_connector_meta(_Out({}), meta)
        return list(meta.renew)

    def renewed_until(done, what):
        """Steps until ``done(renewed)``, then one more (it takes what arrived by then)."""
        got, deadline = [], time.monotonic() + 30
        while not done(got):
            assert time.monotonic() < deadline, f"{what} in 30 s (renewed {got})"
            got += step()
            time.sleep(0.01)
        return got + step()

    try:
        sched.peers = [{"engine_id": "d0"}]
        sched.kv_cache_manager = _Blocks({"r": [7, 8, 9, 3], "s": [1, 2, 4, 5]})
        reqs = {}
        for rid in ("r", "s"):
            reqs[rid] = _Request(rid, {"do_remote_prefill": True, "transfer_id": "t" + rid,
                                       "kvops_producer": server.address}, prompt=100)
            sched.get_num_new_matched_tokens(reqs[rid], 0)
            sched.update_state_after_alloc(reqs[rid], None, 100)
        got = renewed_until(lambda got: got.count("r") >= 2 and "s" in got, "r not renewed twice and s once")
        assert set(got) == {"r", "s"}, got  # P has both, untaken
        server.take("ts")
        server.settle("ts")  # its last chunk went to P's workers: the pushes renew it now
        assert sched.request_finished(reqs["r"])[0] is True  # aborted while P may push
        # An answer P computed before the settle may still be on its way (CI caught one):
        # drop answers until P has counted a question asked after the settle. The poster
        # asks one question per P at a time, so every earlier answer has arrived by then.
        asked_before = server.counters()["probes"]
        renewed_until(lambda _: server.counters()["probes"] > asked_before, "D asked P nothing")
        # from here every answer is P's word after the settle: over four of them, counted
        # on D (an answer's callback is done before the next one is counted), no renewal
        answered = sched.poster.counters()["probed"]
        got = renewed_until(lambda _: sched.poster.counters()["probed"] >= answered + 5,
                            "P answered D fewer than 5 questions")
        assert got == [], got
    finally:
        sched.shutdown()
        server.close()


def _posted_and_owed(server_address, lease_s):
    """A decode scheduler with one request ("r", transfer "tr") P accepted, and no
    liveness question asked yet."""
    from torch_kvops.integrations.vllm.scheduler import ConsumerScheduler

    sched = ConsumerScheduler(KvopsSettings(connector={"lease_s": lease_s}, post_timeout_s=0.1),
                              block_size=32)
    sched.peers = [{"engine_id": "d0"}]
    sched.kv_cache_manager = _Blocks({"r": [7, 8, 9, 3]})
    req = _Request("r", {"do_remote_prefill": True, "transfer_id": "tr",
                         "kvops_producer": server_address}, prompt=100)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 100)
    deadline = time.monotonic() + 30
    while sched.poster.counters()["posted"] < 1:
        assert time.monotonic() < deadline, "P did not accept the destination"
        time.sleep(0.005)
    return sched


def _steps(sched, until, timeout=30.0):
    """D's scheduler steps until ``until(steps)``; per step a namespace: ``start`` and
    ``end`` (monotonic: D's own clock reads in the step fall between them), ``failed``
    (liveness questions that got no answer, counted on D before the step: the answers
    before the last of them were all taken by this step at the latest), ``renew``
    (request ids handed to the workers) and ``took_post`` (P's answer to the post)."""
    from torch_kvops.integrations.vllm.metadata import KvopsConnectorMetadata

    steps, deadline = [], time.monotonic() + timeout
    while not steps or not until(steps):
        assert time.monotonic() < deadline, f"not there in {timeout} s: {steps[-3:]}"
        failed = sched.poster.counters()["probe_failed"]
        meta, start = KvopsConnectorMetadata(), time.monotonic()
        sched.build_connector_meta(_Out({}), meta)
        steps.append(types.SimpleNamespace(start=start, end=time.monotonic(), failed=failed,
                                           renew=list(meta.renew), took_post=bool(meta.recv)))
        time.sleep(0.01)
    return steps


def test_a_silent_prefill_side_renews_for_one_lease_after_its_last_answer_a_gone_one_never():
    """A liveness question that times out is a silence (a live P on a loaded host
    answers late): what P owed is renewed while P answered within the last lease, and
    no longer. A P whose port refuses the connection renews nothing, at once.

    No wall-clock margin: D notes P's last answer (to the post) in the step that takes
    it, so a step renewing on a silence must start before that step's end plus a lease,
    and one ending before that step's start plus a lease renews on every silence it
    took; the steps run until P was silent three more times after the lease ran out."""
    lease_s = 1.2
    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 1})
    host, port = server.address.rsplit(":", 1)
    sched = _posted_and_owed(server.address, lease_s)
    try:
        server.close()
        # the same address now accepts connections and never answers: a stalled P
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind((host, int(port)))
        silent.listen(64)

        def silent_three_times_after_the_lease(steps):
            took = [s for s in steps if s.took_post]
            if not took:
                return False
            after = [s for s in steps if s.start >= took[0].end + lease_s]
            return bool(after) and steps[-1].failed >= after[0].failed + 3

        try:
            steps = _steps(sched, silent_three_times_after_the_lease)
        finally:
            silent.close()
        (answered,) = [s for s in steps if s.took_post]
        renewing = [s for s in steps if s.renew]
        assert all(set(s.renew) == {"r"} for s in renewing), [s.renew for s in renewing]
        late = [s.start - answered.end for s in renewing if s.start >= answered.end + lease_s]
        assert not late, f"renewed on a silence {late} s after the lease of P's last answer ran out"
        within = [s for s in steps if s.end < answered.start + lease_s]
        # every silence the last of these steps had taken renewed "r", once each
        renewed = sum(len(s.renew) for s in within)
        assert renewed >= within[-1].failed - 1, (renewed, within[-1].failed)
        assert renewing, "no silence renewed what P owed"
        assert sched.poster.counters()["probe_failed"] >= 4  # it was asked on, silent
    finally:
        sched.shutdown()

    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 1})
    sched = _posted_and_owed(server.address, lease_s)
    try:
        server.close()  # P is gone: its port refuses every question
        steps = _steps(sched, lambda steps: steps[-1].failed >= 3)  # two refusals taken
        assert [s.renew for s in steps if s.renew] == []
    finally:
        sched.shutdown()


def test_a_prefill_rank_under_external_dp_load_balancing_is_refused_at_start():
    """One `vllm serve --data-parallel-size N` per host is supported (tests/test_vllm_dp.py);
    a rank launched on its own (--data-parallel-rank, external load balancing) is refused
    with what to do instead, before any port is bound (rank 0's endpoint may be on
    another host)."""
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from torch_kvops.integrations.vllm import KvopsLayerwiseConnector

    producer = KVTransferConfig(kv_connector="KvopsLayerwiseConnector",
                                kv_connector_module_path="torch_kvops.integrations.vllm", kv_role="kv_producer")
    config = VllmConfig(kv_transfer_config=producer, parallel_config=ParallelConfig(
        data_parallel_size=2, data_parallel_rank=1, data_parallel_external_lb=True))
    assert config.parallel_config.data_parallel_index == 1 and config.parallel_config.local_engines_only
    with pytest.raises(ValueError, match="external or hybrid DP load balancing"):
        KvopsLayerwiseConnector(config, KVConnectorRole.SCHEDULER, None)

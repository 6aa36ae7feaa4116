"""The client host of tests/test_three_hosts.py: run inside its namespace
(``ip netns exec``), it starts P and D in theirs (`vllm serve`, no address setting, one
fleet key file), the monolithic reference and vllm-router (P first) beside itself, loads
both with vLLM's benchmark client, and writes what it saw as JSON. Two phases on one
fleet: ``deploy`` as started, then ``control``: D restarted with ``$VLLM_HOST_IP=127.0.0.1``
(it advertises loopback, as engines did by default before), which must fail the check.
A test helper, like serving_fleet.py, never product code."""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from serving_fleet import SPIN_S, same_answers
from torch_kvops.serving import prometheus
from torch_kvops.serving.load import LoadClient, random_load_args
from torch_kvops.serving.model import write_serving_model
from torch_kvops.serving.servers import RouterSpec, Servers, ServerSpec

LOAD = dict(num_prompts=8, input_len=300, range_ratio=0.5, seed=21)  # 150-450 tokens
LEASE_S = 6.0  # D recomputes a transfer that never comes after this
API_PORT = 8000  # each host has its own ports


def phase(servers: Servers, client: LoadClient, load: list, ref: dict) -> dict:
    decode = servers["D"]
    before = {s: prometheus.prompt_tokens(decode.metrics(), s) for s in ("local_compute", "external_kv_transfer")}
    got = client.run(servers["router"].url, load)
    return {"wrong": same_answers(got, ref), "completed": got["completed"],
            "prompt_tokens": sum(got["input_lens"]), "requests": LOAD["num_prompts"],
            **{s: prometheus.prompt_tokens(decode.metrics(), s) - before[s] for s in before}}


def run(args, work: str) -> dict:
    """Start the fleet in the emulated hosts (the model and fleet key in ``work``), run
    both phases, stop it; what each phase saw."""
    model = os.path.join(work, "model")
    write_serving_model(model)
    key_file = os.path.join(work, "fleet.key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    same = dict(threads=1, shm_busy_loop_s=SPIN_S, default_addresses=True,
                kv_connector_extra_config={"fleet_key_file": key_file})
    results = {}
    with Servers(args.log_dir) as servers:
        p = servers.add(ServerSpec("P", model, role="prefill", host=args.prefill_addr, port=API_PORT,
                                   netns=args.prefill_ns, **same))
        d = servers.add(ServerSpec("D", model, role="decode", host=args.decode_addr, port=API_PORT,
                                   netns=args.decode_ns, lease_s=LEASE_S, **same))
        servers.add(ServerSpec("ref", model, role="monolithic", host=args.client_addr, threads=1,
                               shm_busy_loop_s=SPIN_S))
        servers.add(RouterSpec("router", [p], [d], host=args.client_addr))
        servers.start_all(900)
        with LoadClient(os.path.join(args.log_dir, "load.log")) as client:
            load = random_load_args(model=model, output_len=4, max_concurrency=4, **LOAD)
            ref = client.run(servers["ref"].url, load)
            assert not any(ref["errors"]), "the reference failed requests"
            results["deploy"] = phase(servers, client, load, ref)
            d.spec.env["VLLM_HOST_IP"] = "127.0.0.1"
            servers.restart("D", 900)
            results["control"] = phase(servers, client, load, ref)
        problems = servers.stop_all()
        results["stop_problems"] = problems
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("prefill-ns", "prefill-addr", "decode-ns", "decode-addr", "client-addr", "out",
                 "log-dir"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvops-three-hosts-") as work:
        results = run(args, work)
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

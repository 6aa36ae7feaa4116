"""Deployed across three hosts as an operator deploys it: network namespaces with their
own addresses from 198.18.0.0/15 on one emulated switch (testing/emulated_hosts.py);
`vllm serve` P on one, D on another, vllm-router (P first), vLLM's benchmark client and
the monolithic reference on the third (tests/three_hosts_driver.py). The engines have
no address setting, only a fleet key file: each finds its host's address.

Every answer equals the reference's and D's prompt tokens came from P (D computed at
most the last token of each). The negative control, in the same run: D restarted with
``$VLLM_HOST_IP=127.0.0.1`` advertises loopback (engines' default before they picked the
host's address): P cannot reach it, and D computes every prompt itself. Every namespace
is removed on exit. Needs root and ``ip`` (a clear error otherwise).
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from torch_kvops.testing.emulated_hosts import EmulatedHosts

pytestmark = [pytest.mark.netns, pytest.mark.vllm, pytest.mark.fleet]

HERE = os.path.dirname(os.path.abspath(__file__))


def test_three_hosts_with_no_address_settings_move_every_prompt_from_prefill():
    log_dir = tempfile.mkdtemp(prefix="kvops-three-hosts-logs-")
    out = os.path.join(log_dir, "result.json")
    with EmulatedHosts(["prefill", "decode", "client"]) as hosts:
        names = [hosts.namespace(h) for h in ("prefill", "decode", "client")]
        cmd = ["ip", "netns", "exec", hosts.namespace("client"), sys.executable,
               os.path.join(HERE, "three_hosts_driver.py"),
               "--prefill-ns", hosts.namespace("prefill"), "--prefill-addr", hosts.address("prefill"),
               "--decode-ns", hosts.namespace("decode"), "--decode-addr", hosts.address("decode"),
               "--client-addr", hosts.address("client"), "--out", out, "--log-dir", log_dir]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
        run = subprocess.run(cmd, env=env, timeout=1500, capture_output=True, text=True)
        assert run.returncode == 0, f"driver failed (logs in {log_dir}):\n{run.stderr[-4000:]}"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(name in left for name in names), left
    with open(out) as f:
        result = json.load(f)
    deploy, control = result["deploy"], result["control"]
    assert not result["stop_problems"], result["stop_problems"]
    assert deploy["completed"] == deploy["requests"] and not deploy["wrong"], deploy
    # every prompt's KV crossed from the prefill host: D computed at most its last token
    assert deploy["local_compute"] <= deploy["requests"], deploy
    assert deploy["local_compute"] + deploy["external_kv_transfer"] == deploy["prompt_tokens"], deploy
    # the control: a D that advertises loopback is out of P's reach and computes the prompts
    assert control["completed"] == control["requests"], control
    assert control["local_compute"] == control["prompt_tokens"], control

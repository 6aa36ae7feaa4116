"""The serving harness (torch_kvops/serving): test model and tokenizer, Prometheus
parsing, the proxy's instance choice, and the reaper: no process of a server outlives
the harness, even when the harness is SIGKILLed (a real `vllm serve` API server with
its engine-core process, and a plain process tree without the reaper as the control)."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

from dataclasses import dataclass

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.load import LoadClient, LoadError
from torch_kvops.serving.model import random_prompt, vocabulary, write_serving_model
from torch_kvops.serving import servers as servers_module
from torch_kvops.serving.fronts import ProxySpec, _Launched
from torch_kvops.serving.ports import free_port, listens_on
from torch_kvops.serving.servers import REAPER, ServerError, Servers, ServerSpec, merged
from torch_kvops.serving.upstreams import Instance, Pool, parse_instances

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def alive(pids):
    """The pids that still exist and are not zombies."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            left.append(pid)
    return left


def wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def test_tokenizer_maps_words_to_ids_and_chat_works(tmp_path):
    from transformers import AutoTokenizer

    config = write_serving_model(str(tmp_path), layers=1, hidden=64, heads=2, kv_heads=1, vocab=128)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == config["vocab_size"] == len(vocabulary(128))
    prompt = random_prompt(50, 128, random.Random(0))
    ids = tok.encode(prompt)
    assert len(ids) == 50 and all(i >= 7 for i in ids)  # one word, one ordinary token
    assert tok.decode(ids) == prompt
    assert tok.encode("w10 nonsense") == [10, 3]  # unknown words are <unk>
    chat = tok.apply_chat_template([{"role": "user", "content": "w10 w11"}],
                                   add_generation_prompt=True, tokenize=False)
    assert tok.encode(chat) == [vocabulary(128).index("user"), 10, 11, vocabulary(128).index("assistant")]


def test_prometheus_text_is_parsed_and_summed():
    text = textwrap.dedent('''\
        # HELP vllm:num_requests_running Number of requests.
        # TYPE vllm:num_requests_running gauge
        vllm:num_requests_running{engine="0",model_name="m"} 2.0
        vllm:num_requests_running{engine="1",model_name="m"} 1.0
        vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
        vllm:kvops_requests_failed_total{cause="lease",engine="0",model_name="m"} 3.0
        vllm:kvops_requests_failed_total{cause="transport",engine="0",model_name="m"} 1.0
        ''')
    samples = prometheus.parse(text)
    assert prometheus.total(samples, "vllm:num_requests_running") == 3.0
    assert prometheus.total(samples, "vllm:num_requests_running", engine="1") == 1.0
    assert prometheus.total(samples, "vllm:kvops_requests_failed_total", cause="lease") == 3.0
    assert prometheus.find(samples, "vllm:kvops_") == {
        "vllm:kvops_requests_failed_total{cause=lease}": 3.0,
        "vllm:kvops_requests_failed_total{cause=transport}": 1.0}
    assert prometheus.engine_state(samples) == {"running": 3.0, "waiting": 0.0, "kv_cache_usage": 0.25}
    assert not prometheus.is_idle(samples)
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        prometheus.parse("what is this")


def test_pool_picks_the_least_loaded_and_avoids_failed_instances():
    a, b = Instance("http://a"), Instance("http://b")
    pool = Pool("decode", [a, b], down_s=60.0)
    assert {pool.pick().url, pool.pick().url} == {"http://a", "http://b"}  # ties alternate
    a.in_flight = 2
    assert pool.pick() is b
    pool.mark_down(b)
    assert pool.pick() is a  # b is down, a is busy but up
    assert pool.pick(exclude=[a]) is b  # the only one left, even down
    assert pool.pick(exclude=[a, b]) is None
    with pytest.raises(ValueError, match="side channels"):
        parse_instances("http://p1,http://p2", "127.0.0.1:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_instances("http://p1", "nowhere")


def test_server_specs_carry_the_connector_settings():
    with pytest.raises(ValueError, match="role"):
        ServerSpec("x", "/m", role="both")
    p = ServerSpec("P", "/m", role="prefill", side_channel_port=7100,
                   kv_connector_extra_config={"connector": {"max_retries": 3}})
    config = p.kv_transfer_config()
    assert config["kv_role"] == "kv_producer"
    assert config["kv_connector_extra_config"]["side_channel_port"] == 7100
    assert config["kv_connector_extra_config"]["connector"] == {"max_retries": 3}
    d = ServerSpec("D", "/m", role="decode", lease_s=7.0,
                   kv_connector_extra_config={"connector": {"integrity_check": True}})
    extra = d.kv_transfer_config()["kv_connector_extra_config"]
    assert extra["connector"] == {"lease_s": 7.0, "integrity_check": True}  # merged, not replaced
    assert d.kv_transfer_config()["kv_load_failure_policy"] == "recompute"
    assert ServerSpec("R", "/m").kv_transfer_config() is None
    assert "--kv-transfer-config" not in ServerSpec("R", "/m").command()
    assert merged({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}


def test_ports_are_never_handed_out_twice_and_a_server_is_ready_only_on_its_own_port(tmp_path):
    """Two servers started together once got one port (two proxies of a fleet): the
    second died at bind while /health answered from the first, and a test drove the
    wrong proxy. Ports are handed out once, and readiness asks who listens."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with Servers(str(tmp_path)) as servers:
        # upstreams that never start: a proxy answers /health without them
        p = servers.add(ServerSpec("P", "/m", role="prefill", port=free_port(),
                                   side_channel_port=free_port()))
        d = servers.add(ServerSpec("D", "/m", role="decode", port=free_port()))
        first = servers.add(ProxySpec("first", [p], [d]))
        servers.start(["first"], timeout=120)
        assert listens_on(first.processes(), first.spec.port)
        assert not listens_on({os.getpid()}, first.spec.port)  # the check can say no
        second = servers.add(ProxySpec("second", [p], [d], port=first.spec.port))
        with pytest.raises(ServerError, match=f"port {first.spec.port} is held by another process"):
            servers.start(["second"], timeout=120)
        assert "address already in use" in second.log_tail()
        assert first.healthy()


def test_processes_given_parts_of_the_range_never_draw_the_same_port(monkeypatch):
    """The suite's two workers start fleets side by side (tests/conftest.py): each
    draws from its own part, so they cannot pick one port at the same moment."""
    drawn = {}
    for part in ("0/2", "1/2"):
        monkeypatch.setenv("KVOPS_PORT_PART", part)
        drawn[part] = {free_port() for _ in range(200)}
    assert not drawn["0/2"] & drawn["1/2"]
    assert max(drawn["0/2"]) < min(drawn["1/2"]), "the parts overlap"
    for wrong in ("2/2", "1", "a/b"):
        monkeypatch.setenv("KVOPS_PORT_PART", wrong)
        with pytest.raises(ValueError, match="expected i/n"):
            free_port()


# A server like SGLang's: its HTTP server (uvicorn) fails at bind, logs it, and the
# process stays up (here a non-daemon thread holds it, as SGLang's own threads did).
STAYS_UP = textwrap.dedent("""
    import sys, threading, time, uvicorn
    threading.Thread(target=time.sleep, args=(300,)).start()
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")
""")


@dataclass
class StaysUpSpec(_Launched):
    name: str

    def command(self) -> list:
        return [sys.executable, "-c", STAYS_UP, str(self.port)]


@pytest.mark.parametrize("kind", ["exits", "stays_up"])
def test_a_server_whose_picked_port_another_process_took_starts_again_on_a_fresh_one(
        tmp_path, monkeypatch, kind):
    """Seen in a CI run: a port the harness picked was bound by another process before
    SGLang's P bound it; P logged "address already in use", stayed up, and its fixture
    waited out 600 s. A server on picked ports now starts again on fresh ones; a server
    on given ports fails at once, with its log."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    handed = iter([taken])
    monkeypatch.setattr(servers_module, "free_port", lambda host: next(handed, None) or free_port(host))
    with holder, Servers(str(tmp_path)) as servers:
        upstreams = ([servers.add(ServerSpec("P", "/m", role="prefill", port=free_port(),
                                             side_channel_port=free_port()))],
                     [servers.add(ServerSpec("D", "/m", role="decode", port=free_port()))])
        spec = ProxySpec("moved", *upstreams) if kind == "exits" else StaysUpSpec("moved")
        moved = servers.add(spec)
        started = time.monotonic()
        servers.start(["moved"], timeout=60)
        assert time.monotonic() - started < 30
        assert moved.starts == 2 and moved.spec.port != taken
        assert listens_on(moved.processes(), moved.spec.port)
        assert "already in use" in open(moved.log_path).read()
        given = ProxySpec("given", *upstreams, port=taken) if kind == "exits" else StaysUpSpec("given", port=taken)
        servers.add(given)
        with pytest.raises(ServerError, match=f"port {taken} is held by another process"):
            servers.start(["given"], timeout=60)
        assert time.monotonic() - started < 60


# A process tree like a server's: a parent and a grandchild that outlives it by default.
TREE = ("import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)")


def _start_tree(reaper: bool) -> tuple:
    """A harness process (SIGKILLed by the test) that starts TREE in a new session,
    through the reaper or directly; returns it and the pids of the tree."""
    launcher = [REAPER, "--grace", "2", "--", sys.executable] if reaper else []
    script = textwrap.dedent(f'''
        import json, subprocess, sys, time
        from torch_kvops.serving.reaper import descendants_and_group
        proc = subprocess.Popen([sys.executable, *{launcher!r}, "-c", {TREE!r}],
                                start_new_session=True)
        deadline = time.monotonic() + 30
        while len(descendants_and_group(proc.pid, proc.pid)) < (2 if {reaper!r} else 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("the process tree did not start")
            time.sleep(0.05)
        print(json.dumps(sorted(descendants_and_group(proc.pid, proc.pid) | {{proc.pid}})), flush=True)
        time.sleep(300)
        ''')
    harness = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=ENV)
    line = harness.stdout.readline()
    if not line:
        harness.wait(10)
        raise AssertionError(f"the harness ended ({harness.returncode}) before starting the tree")
    return harness, json.loads(line)


def test_shm_busy_loop_setting_reaches_vllms_message_queue_readers_only_when_asked():
    """ServerSpec(shm_busy_loop_s=...) (a benchmark aid) shortens the busy-spin of vLLM's
    message-queue readers in the server's processes; without it vLLM's 1 s stands."""
    probe = textwrap.dedent("""
        import zmq
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        ctx = zmq.Context()
        reader = SpinCondition(True, ctx, "ipc:///tmp/kvops-spin-probe")
        print(reader.busy_loop_s)
        reader.local_notify_socket.close(0); reader.read_cancel_socket.close(0)
        reader.write_cancel_socket.close(0); ctx.term()
    """)
    spec = ServerSpec("P", "/nonexistent", shm_busy_loop_s=0.002)

    def busy_loop_s(env):
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    assert busy_loop_s(spec.environment()) == 0.002
    assert busy_loop_s(ServerSpec("P", "/nonexistent").environment()) == 1.0


def test_a_servers_own_python_path_goes_before_the_harnesss_not_instead():
    env = ServerSpec("P", "/nonexistent", shm_busy_loop_s=0.002, env={"PYTHONPATH": "/plugins"}
                     ).environment()
    first, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert first == "/plugins" and any(p.endswith("shm_spin") for p in rest), env["PYTHONPATH"]


def test_the_warm_load_client_reports_a_failed_load_and_runs_the_next_in_the_same_child():
    """LoadClient keeps vLLM's benchmark client in one child: a load that fails (here
    an option it does not know) is a LoadError naming the cause, and the child lives
    on for the next load; close() ends it."""
    with LoadClient() as client:
        with pytest.raises(LoadError, match="SystemExit"):
            client.run("http://127.0.0.1:9", ["--no-such-option"])
        child = client._proc
        with pytest.raises(LoadError, match="SystemExit"):
            client.run("http://127.0.0.1:9", ["--no-such-option"])
        assert client._proc is child and child.poll() is None
    assert child.poll() is not None


def test_reaper_ends_the_tree_when_the_harness_is_sigkilled_and_without_it_the_tree_survives():
    harness, pids = _start_tree(reaper=True)
    assert len(pids) >= 3, pids  # reaper, parent, grandchild
    harness.kill()
    harness.wait(10)
    assert wait_gone(pids, 5.0) == [], "the reaper left processes behind"

    # the control: the same tree without the reaper outlives its harness
    harness, pids = _start_tree(reaper=False)
    harness.kill()
    harness.wait(10)
    try:
        time.sleep(1.0)
        assert len(alive(pids)) == len(pids) >= 2, pids
    finally:
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(pids, 5.0) == []


HARNESS = textwrap.dedent('''
    import json, sys, time
    from torch_kvops.serving.servers import Servers, ServerSpec
    with Servers(sys.argv[2]) as servers:
        server = servers.add(ServerSpec("ref", sys.argv[1], max_model_len=1024, threads=1))
        servers.start_all(600)
        print(json.dumps({"pids": sorted(server.processes()), "url": server.url}), flush=True)
        time.sleep(600)
    ''')


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("model"))
    write_serving_model(directory, max_len=1024)
    return directory


def test_sigkilled_harness_leaves_no_vllm_process(small_model, tmp_path):
    """A real API server: its API process, engine core (and any worker) all go."""
    started = time.monotonic()
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, small_model, str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        line = harness.stdout.readline()
        info = json.loads(line) if line.startswith("{") else None
        assert info is not None, line + harness.stdout.read()[-4000:] if harness.poll() is not None else line
        pids = info["pids"]
        # the reaper, the API server and its engine-core process
        names = [open(f"/proc/{pid}/cmdline").read().replace("\0", " ") for pid in alive(pids)]
        assert any("EngineCore" in n for n in names), names
        assert any("vllm.entrypoints.openai.api_server" in n for n in names), names
        assert any("torch_kvops/serving/reaper.py" in n for n in names), names
    finally:
        harness.kill()
        harness.wait(10)
    left = wait_gone(pids, 10.0)
    assert left == [], f"left behind after the harness's SIGKILL: {left}"
    print(f"vLLM server started and reaped in {time.monotonic() - started:.1f} s")

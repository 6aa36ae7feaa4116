"""`vllm serve` P/D behind our proxy (torch_kvops/serving/proxy.py), real API servers:
2 P and 2 D with KvopsLayerwiseConnector and a monolithic reference, shared by the
module (start-up dominates). Answers through the proxy (completions and chat, streaming
and not, D first and concurrent dispatch) equal the reference's (greedy) while D
computes at most one block of each prompt; a dead instance is avoided by a retry
before the first byte and takes traffic again after its restart; a client that leaves
mid-stream aborts the request on P and D (block pools free). The negative control: a
proxy that sends D no kv_transfer_params makes the "D computed at most one block" check
fail."""
import json
import random
import socket
import time
import urllib.request

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.model import random_prompt, write_serving_model
from torch_kvops.serving.servers import ProxySpec, Servers, ServerSpec

BLOCK = 32
BUDGET = 256  # P prefills a 600-word prompt in 3 chunks
VOCAB = 1024
PROMPT_WORDS = (40, 600)
NEW_TOKENS = 6
PS, DS = ("P1", "P2"), ("D1", "D2")


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_stream(url: str, body: dict, timeout: float = 120.0) -> str:
    """The text of a streamed answer (server-sent events), chunks joined."""
    req = urllib.request.Request(url, json.dumps(dict(body, stream=True)).encode(),
                                 {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def answer_text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("model"))
    write_serving_model(model, max_len=4096)
    logs = str(tmp_path_factory.mktemp("logs"))
    common = dict(max_num_batched_tokens=BUDGET, block_size=BLOCK, threads=1, served_model_name="m")
    with Servers(logs) as servers:
        ref = servers.add(ServerSpec("ref", model, role="monolithic", **common))
        # P holds a finished request's blocks this long for a destination (the sabotaged
        # proxy's never comes)
        ps = [servers.add(ServerSpec(n, model, role="prefill", **common,
                                     kv_connector_extra_config={"hold_for_decode_s": 5.0}))
              for n in PS]
        ds = [servers.add(ServerSpec(n, model, role="decode", lease_s=10.0, **common)) for n in DS]
        for order in ("d-first", "concurrent"):
            servers.add(ProxySpec(f"proxy-{order}", ps, ds, order=order,
                                  extra_args=["--down-s", "3", "--retries", "3"]))
        # the negative control: D gets no kv_transfer_params and computes the prompt itself
        servers.add(ProxySpec("proxy-sabotaged", ps, ds, extra_args=["--no-decode-params"]))
        started = time.monotonic()
        servers.start_all(timeout=900)
        print(f"\n5 vLLM servers and 3 proxies ready in {time.monotonic() - started:.0f} s")
        rng = random.Random(7)
        prompts = [random_prompt(n, VOCAB, rng) for n in PROMPT_WORDS]
        yield servers, ref, prompts


def decode_local_tokens(servers) -> float:
    """Prompt tokens the D servers computed themselves, as vLLM counts them."""
    return sum(prometheus.total(servers[d].metrics(), "vllm:prompt_tokens_by_source_total",
                                source="local_compute") for d in DS)


def assert_decode_computed_at_most_one_block(before: float, after: float, requests: int) -> None:
    assert after - before <= BLOCK * requests, \
        f"D computed {after - before} prompt tokens itself for {requests} requests"


def wait_all_idle(servers, timeout: float = 60.0) -> dict:
    """Every running P and D with no request running or waiting and its block pool free."""
    deadline = time.monotonic() + timeout
    while True:
        states = {n: prometheus.engine_state(servers[n].metrics()) for n in PS + DS
                  if servers[n].alive()}
        if all(s == {"running": 0, "waiting": 0, "kv_cache_usage": 0} for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle within {timeout} s: {states}")
        time.sleep(0.2)


def proxy_counters(proxy) -> dict:
    return prometheus.find(prometheus.fetch(proxy.url), "kvops_proxy_")


def body_for(kind: str, prompt: str) -> dict:
    if kind == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": NEW_TOKENS, "temperature": 0}
    return {"model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}


@pytest.mark.parametrize("order", ["d-first", "concurrent"])
def test_answers_equal_the_reference_and_d_computes_at_most_one_block(cluster, order):
    servers, ref, prompts = cluster
    proxy = servers[f"proxy-{order}"]
    requests = 0
    before = decode_local_tokens(servers)
    for kind, path in (("completion", "/v1/completions"), ("chat", "/v1/chat/completions")):
        for prompt in prompts:
            body = body_for(kind, prompt)
            want = answer_text(post(ref.url + path, body))
            got = post(proxy.url + path, body)
            assert answer_text(got) == want, (order, kind, len(prompt.split()))
            # D's connector reports the prompt tokens it computed (vLLM recomputes the last)
            assert got["kv_transfer_params"]["kvops_local_prompt_tokens"] <= BLOCK, got["kv_transfer_params"]
            assert post_stream(proxy.url + path, body) == want, (order, kind, "stream")
            requests += 2
    assert_decode_computed_at_most_one_block(before, decode_local_tokens(servers), requests)
    wait_all_idle(servers)


def test_requests_spread_over_both_prefill_and_decode_instances(cluster):
    servers, ref, prompts = cluster
    proxy = servers["proxy-d-first"]
    before = proxy_counters(proxy)
    for prompt in prompts * 2:
        post(proxy.url + "/v1/completions", body_for("completion", prompt))
    after = proxy_counters(proxy)
    for name in PS + DS:
        key = next(k for k in after if k.startswith("kvops_proxy_upstream_requests_total")
                   and servers[name].url in k)
        assert after[key] - before.get(key, 0) >= 1, (name, after)


def test_sabotaged_proxy_makes_the_one_block_check_fail(cluster):
    """The negative control of the check above: without kv_transfer_params D computes
    the whole prompt (the answer is still right), and the check goes red."""
    servers, ref, prompts = cluster
    body = body_for("completion", prompts[1])
    before = decode_local_tokens(servers)
    got = post(servers["proxy-sabotaged"].url + "/v1/completions", body)
    assert answer_text(got) == answer_text(post(ref.url + "/v1/completions", body))
    with pytest.raises(AssertionError, match="D computed"):
        assert_decode_computed_at_most_one_block(before, decode_local_tokens(servers), 1)
    wait_all_idle(servers)  # P, which never got D's destination, prefilled alone and freed it


def test_client_disconnect_mid_stream_aborts_on_p_and_d(cluster):
    servers, ref, prompts = cluster
    proxy = servers["proxy-d-first"]
    body = dict(body_for("completion", prompts[1]), max_tokens=3000, ignore_eos=True, stream=True)
    host, port = proxy.url.rsplit("/", 1)[1].split(":")
    payload = json.dumps(body).encode()
    generated = sum(prometheus.total(servers[d].metrics(), "vllm:generation_tokens_total") for d in DS)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while received.count(b"data: ") < 5:  # a few tokens streamed: D is decoding
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        running = sum(prometheus.engine_state(servers[d].metrics())["running"] for d in DS)
        assert running == 1, "D should be generating the 3000 tokens"
    left = time.monotonic()
    states = wait_all_idle(servers, timeout=20.0)  # 3000 tokens would take minutes
    print(f"P and D idle with free block pools {time.monotonic() - left:.2f} s after the client left")
    assert proxy_counters(proxy).get("kvops_proxy_client_disconnects_total", 0) >= 1
    # D stopped generating when the client left: far fewer than the 3000 tokens asked for
    generated = sum(prometheus.total(servers[d].metrics(), "vllm:generation_tokens_total")
                    for d in DS) - generated
    assert 5 <= generated < 1000, generated
    assert all(s["kv_cache_usage"] == 0 for s in states.values())


def test_dead_instances_are_retried_around_and_a_restarted_one_takes_traffic(cluster):
    """Last in the module: D1 stays dead (a restart costs a server start-up)."""
    servers, ref, prompts = cluster
    proxy = servers["proxy-d-first"]
    body = body_for("completion", prompts[0])
    want = answer_text(post(ref.url + "/v1/completions", body))
    retries_before = proxy_counters(proxy).get("kvops_proxy_retries_total", 0)
    servers.kill("P1")
    servers.kill("D1")
    try:
        for _ in range(4):  # ties alternate: the dead ones are picked first at least once
            got = post(proxy.url + "/v1/completions", body)
            assert answer_text(got) == want
            assert got["kv_transfer_params"]["kvops_local_prompt_tokens"] <= BLOCK
        assert proxy_counters(proxy)["kvops_proxy_retries_total"] > retries_before
    finally:
        started = time.monotonic()
        servers.restart("P1", timeout=600)  # same ports and settings
        print(f"P1 restarted in {time.monotonic() - started:.0f} s")
    time.sleep(3.5)  # the proxy's --down-s: P1 may be picked again
    before = proxy_counters(proxy)
    for _ in range(4):
        got = post(proxy.url + "/v1/completions", body)
        assert answer_text(got) == want
        assert got["kv_transfer_params"]["kvops_local_prompt_tokens"] <= BLOCK
    after = proxy_counters(proxy)
    key = next(k for k in after if k.startswith("kvops_proxy_upstream_requests_total")
               and servers["P1"].url in k)
    assert after[key] > before[key], "P1 took no request after its restart"
    wait_all_idle(servers)

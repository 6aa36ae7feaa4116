"""Who may talk on the control channel: the handshake, request ownership, bounded
buffers, and exactly-once reporting across chunks (real processes, real Mooncake)."""
import json
import socket
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.control import (MAX_HANDSHAKE_LINE, MAX_PENDING_HANDSHAKES, ControlClient,
                                 ControlServer, new_secret, proof)
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.pushes import push_and_receive, push_step

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 32, (2, 8, 16)  # 1 KiB blocks
FAST = dict(transfer_timeout_s=3.0, max_retries=1, retry_backoff_s=0.02, lease_s=10.0,
            control_timeout_s=2.0, quarantine_s=0.1,
            # these consumers take pushes they were not told to expect unless a test
            # expects; the default (refused) is tests/test_admission.py's
            accept_unsolicited_pushes=True)


def make_producer(**config):
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**dict(FAST, **config)))
    conn.register_kv_caches(caches)
    return conn, caches, transport


@pytest.fixture
def consumer():
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    yield proc
    proc.stop()


@pytest.fixture
def producer():
    conn, caches, transport = make_producer()
    yield conn, caches
    conn.close()
    transport.close()


def address(info):
    host, port = info["control_address"].rsplit(":", 1)
    return host, int(port)


def read_until_closed(sock, timeout=5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:  # closed with our unread bytes still in its buffer
            return data
        if not chunk:
            return data
        data += chunk


def wait_for_counter(consumer, name, at_least, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while consumer.call("stats")[name] < at_least:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def collect(conn, wanted, timeout):
    """Every report of the producer until ``wanted`` ids were all reported (or timeout);
    returns lists so that a second report of one id shows."""
    finished, failed = [], []
    deadline = time.monotonic() + timeout
    while not set(wanted) <= set(finished) | set(failed) and time.monotonic() < deadline:
        f, x = conn.get_finished()
        finished += sorted(f)
        failed += sorted(x)
        time.sleep(0.01)
    return finished, failed


# ---------------------------------------------------------------------- the outsider of the issue

def test_outsider_knowing_only_the_port_cannot_finish_a_request(consumer, producer):
    """The attack from the issue: hello, begin for an expected request, chunk last. The
    consumer closes the connection after hello (no proof) and reads nothing else; the
    real producer's begin is accepted afterwards and its bytes land."""
    consumer.call("expect", ["victim"])
    with socket.create_connection(address(consumer.info), timeout=5) as rogue:
        lines = [{"op": "hello", "producer": "rogue", "nonce": "ab" * 32, "staging": True},
                 {"op": "begin", "reqs": ["victim"]},
                 {"op": "chunk", "req": "victim", "last": True, "bytes": 0},
                 {"op": "failed", "req": "victim", "reason": "denial"}]
        rogue.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in lines))
        answer = read_until_closed(rogue)
    assert b'"begun"' not in answer, "nothing after hello may be read before the proof"
    finished, failed, _ = consumer.call("wait", ["victim"], 1.0)
    assert not finished and not failed
    assert wait_for_counter(consumer, "control_auth_failed", 1)

    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    push_and_receive(conn, caches, consumer, TransferRequest("victim", peer, [3, 4], [7, 9]))


def test_a_producer_with_the_wrong_secret_is_refused(consumer, producer):
    conn, _ = producer
    forged = dict(consumer.info, secret=new_secret())
    with pytest.raises(ConnectionError, match="handshake"):
        conn.add_peer(forged)
    # The producer saw the consumer's proof fail and hung up; the consumer counts it
    # when it reads the close, a moment later.
    assert wait_for_counter(consumer, "control_auth_failed", 1)
    with pytest.raises(ValueError, match="secret"):
        conn.add_peer({k: v for k, v in consumer.info.items() if k != "secret"})
    assert conn.add_peer(consumer.info)  # the real one still works


def test_the_same_producer_proving_itself_again_replaces_its_lingering_session(consumer):
    """A producer's connection can linger half-open on the consumer (a partition, a
    peer that vanished without a FIN). When the same producer proves itself again, the
    new session replaces the old one (which is closed) instead of being refused."""
    old = ControlClient(consumer.info["control_address"], timeout_s=2.0)
    old.connect()
    assert old.handshake(consumer.info["secret"], "producer-x", staging=False)["op"] == "welcome"
    new = ControlClient(consumer.info["control_address"], timeout_s=2.0)
    new.connect()
    try:
        assert new.handshake(consumer.info["secret"], "producer-x", staging=False)["op"] == "welcome"
        assert wait_for_counter(consumer, "control_replaced", 1)
        with pytest.raises(ConnectionError):  # the old one was closed by the consumer
            old.receive(2.0)
    finally:
        old.close()
        new.close()


def test_the_producer_refuses_a_consumer_that_cannot_prove_the_secret(consumer, producer):
    """Mutual: a server at the consumer's control address that does not know the
    secret (here: one with another secret) is refused before any notice is sent."""
    heard = []
    impostor = ControlServer("127.0.0.1", lambda m, s: heard.append(m), lambda s: None, lambda: None,
                             secret=new_secret())
    try:
        conn, _ = producer
        with pytest.raises(ConnectionError, match="could not prove"):
            conn.add_peer(dict(consumer.info, control_address=impostor.address))
        assert heard == [], "the impostor must not get past the handshake"
    finally:
        impostor.close()


# ---------------------------------------------------------------------- bounded buffers

@pytest.fixture
def server():
    heard, closed = [], []
    secret = new_secret()

    def on_message(message, session):
        heard.append((session.producer, message))
        if message["op"] == "hello":
            session.reply({"op": "welcome", "staging": None})

    srv = ControlServer("127.0.0.1", on_message, closed.append, lambda: None, secret=secret,
                        max_line_bytes=8 << 10, handshake_timeout_s=1.0)
    srv.heard, srv.closed, srv.secret = heard, closed, secret
    yield srv
    srv.close()


def client(srv, producer="p1"):
    c = ControlClient(srv.address, timeout_s=5.0, retries=0)
    c.connect()
    c.handshake(srv.secret, producer, staging=False)
    return c


def test_endless_lines_floods_and_bad_json_drop_only_their_connection(server):
    good = client(server, "good")
    attacks = {
        "endless line before the handshake": b"x" * (MAX_HANDSHAKE_LINE + 10),
        "malformed JSON": b"{not json\n",
        "not an object": b"[1, 2]\n",
        "a flood of hellos": b"".join(json.dumps({"op": "hello", "producer": "f", "nonce": "cd" * 32})
                                      .encode() + b"\n" for _ in range(1000)),
    }
    for name, payload in attacks.items():
        with socket.create_connection(address({"control_address": server.address}), timeout=5) as s:
            s.sendall(payload)
            read_until_closed(s)  # closed by the server, whatever it answered first
    authed = client(server, "noisy")
    authed._sock.sendall(b"y" * (16 << 10))  # a line over max_line_bytes after the handshake
    with pytest.raises(ConnectionError):
        authed.receive(5.0)
    authed.close()
    deadline = time.monotonic() + 5
    while [s.producer for s in server.closed] != ["noisy"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.producer for s in server.closed] == ["noisy"]
    counters = server.counters_snapshot()
    assert counters["control_auth_failed"] >= len(attacks) and counters["control_dropped"] == 1
    good.send({"op": "ping"})  # the good connection was never disturbed
    deadline = time.monotonic() + 5
    while not any(m.get("op") == "ping" for _, m in server.heard) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("good", {"op": "ping"}) in server.heard
    good.close()


def test_silent_and_surplus_connections_are_closed(server):
    silent = [socket.create_connection(address({"control_address": server.address}), timeout=5)
              for _ in range(MAX_PENDING_HANDSHAKES + 4)]
    try:
        for s in silent:  # every one is closed: the surplus at once, the rest after 1 s
            read_until_closed(s, timeout=10.0)
    finally:
        for s in silent:
            s.close()
    counters = server.counters_snapshot()
    assert counters["control_refused_busy"] >= 4
    assert counters["control_auth_failed"] >= MAX_PENDING_HANDSHAKES - 4
    client(server, "after").close()  # and the server still serves


def test_the_handshake_proofs_are_bound_to_role_nonces_and_producer():
    secret, a, b = new_secret(), "aa" * 32, "bb" * 32
    base = proof(secret, "producer", a, b, "p")
    assert base != proof(secret, "consumer", a, b, "p")
    assert base != proof(secret, "producer", b, a, "p")
    assert base != proof(secret, "producer", a, b, "q")
    assert base != proof(new_secret(), "producer", a, b, "p")
    with pytest.raises(ValueError, match="hex"):
        ControlServer("127.0.0.1", None, None, None, secret="not hex")


# ---------------------------------------------------------------------- ownership

def test_only_the_session_that_began_a_request_may_end_or_scatter_it(consumer, producer):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    push_step(conn, caches, [TransferRequest("mine", peer, [1, 2], [20, 21], last_chunk=False)])

    # Another producer that knows the secret (a second prefill instance reusing the id).
    other, other_caches, other_transport = make_producer()
    try:
        other_peer = other.add_peer(consumer.info)
        push_step(other, other_caches, [TransferRequest("mine", other_peer, [5], [25])])
        _, failed = collect(other, ["mine"], 5.0)
        assert failed == ["mine"], "its begin is refused: the id belongs to the first producer"
    finally:
        other.close()
        other_transport.close()

    # A raw authenticated session: failed / chunk / scatter for a request it did not begin.
    intruder = ControlClient(consumer.info["control_address"], timeout_s=5.0, retries=0)
    intruder.connect()
    welcome = intruder.handshake(consumer.info["secret"], "intruder", staging=True)
    assert welcome["staging"], "CPU caches: the consumer grants staging"
    intruder.send({"op": "failed", "req": "mine", "reason": "denial"})
    intruder.send({"op": "chunk", "req": "mine", "last": True, "bytes": 0})
    intruder.send({"op": "scatter", "layer": 0, "slot": 0, "dst": [20]})
    ack = intruder.receive(5.0)
    assert ack == {"op": "ack", "slot": 0, "refused": True}
    intruder.close()
    finished, failed, _ = consumer.call("wait", ["mine"], 0.5)
    assert not finished and not failed, "nobody but its producer may end the request"
    stats = consumer.call("stats")
    assert stats["control_not_owner"] >= 3 and stats["scatter_refused"] == 1

    received = push_and_receive(conn, caches, consumer,
                                TransferRequest("mine", peer, [3], [22], last_chunk=True))
    for layer in range(LAYERS):
        assert np.array_equal(received[layer][[20, 21, 22]], caches[layer][[1, 2, 3]].numpy())
        assert (received[layer][25] == -7.0).all(), "the refused producer wrote nothing"


# ---------------------------------------------------------------------- exactly once across chunks

def test_later_chunks_of_a_request_to_a_dead_peer_are_not_reported_again():
    """The soak finding: every later chunk of a chunked request to a dead consumer was
    reported failed again. The quarantine is long here, so the later chunks arrive
    while the failure waits in it (not yet visible to get_finished)."""
    conn, caches, transport = make_producer(quarantine_s=1.5)
    alive = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    doomed = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    try:
        p_alive, p_doomed = conn.add_peer(alive.info), conn.add_peer(doomed.info)
        push_step(conn, caches, [TransferRequest("c", p_doomed, [0], [0], last_chunk=False),
                            TransferRequest("k", p_alive, [0], [0], last_chunk=False)])
        doomed.kill()
        push_step(conn, caches, [TransferRequest("c", p_doomed, [1], [1], last_chunk=False),
                            TransferRequest("k", p_alive, [1], [1], last_chunk=False)])
        push_step(conn, caches, [TransferRequest("c", p_doomed, [2], [2], last_chunk=True),
                            TransferRequest("k", p_alive, [2], [2], last_chunk=True)])
        finished, failed = collect(conn, ["c", "k"], 10.0)
        time.sleep(1.6)  # anything still quarantined comes out now
        more_finished, more_failed = collect(conn, [], 0.0)
        assert finished + more_finished == ["k"]
        assert failed + more_failed == ["c"], "reported once, whatever chunks followed"
        assert conn.stats()["chunks_after_failure"] == 1
        got, bad, _ = alive.call("wait", ["k"], 10.0)
        assert got == {"k"} and not bad
        with pytest.raises(ValueError, match="already reported finished"):
            conn.start_step([TransferRequest("k", p_alive, [3], [3])])
        # with partial (as the engine adapters call it) a reused id fails alone, each
        # time it comes, and the request it once named keeps its bytes (issue 58)
        before = alive.call("caches")
        for n in range(2):
            refused = push_step(conn, caches, [TransferRequest("k", p_alive, [3], [3]),
                                               TransferRequest(f"n{n}", p_alive, [4], [4 + n])],
                                partial=True)
            assert list(refused) == ["k"] and "already reported finished" in refused["k"]
            finished, failed = collect(conn, ["k", f"n{n}"], 10.0)
            assert (finished, failed) == ([f"n{n}"], ["k"]), "the reused id fails, its neighbour goes"
            assert alive.call("wait", [f"n{n}"], 10.0)[0] == {f"n{n}"}
        received = alive.call("caches")
        assert all(np.array_equal(received[layer][[0, 1, 2, 3]], before[layer][[0, 1, 2, 3]])
                   for layer in range(LAYERS)), "nothing was written for the reused id"
        assert all(np.array_equal(received[layer][[4, 5]], caches[layer][[4, 4]].numpy())
                   for layer in range(LAYERS))
    finally:
        conn.close()
        transport.close()
        alive.stop()
        doomed.kill()


def test_a_producer_that_stops_reading_delays_only_its_own_answers():
    """Every message is answered with 64 KiB. A producer that never reads fills its
    socket; the server thread goes on answering another producer at once (its answers
    queue in the reader's outbox, not in a blocking send), and drops the reader once
    its answers went unread for ``send_timeout_s``."""
    secret, closed = new_secret(), []

    def on_message(message, session):
        if message["op"] == "hello":
            session.reply({"op": "welcome", "staging": None})
        else:
            session.reply({"op": "pong", "pad": "x" * (64 << 10)})

    send_timeout_s = 3.0
    srv = ControlServer("127.0.0.1", on_message, closed.append, lambda: None, secret=secret,
                        send_timeout_s=send_timeout_s)
    srv.secret = secret
    reader, stalled = client(srv, "reader"), client(srv, "stalled")
    try:
        stalled._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for _ in range(400):  # 25 MiB of answers asked for: far beyond the socket buffers
            try:
                stalled.send({"op": "ping"})
            except ConnectionError:  # dropped once its unread answers outgrew the outbox bound
                break
        worst = 0.0
        for _ in range(20):
            started = time.monotonic()
            reader.send({"op": "ping"})
            answer = reader.receive(5.0)
            worst = max(worst, time.monotonic() - started)
            assert answer is not None and answer["op"] == "pong"
        print(f"slowest answer beside a producer that does not read: {worst * 1e3:.1f} ms")
        # a send that blocked on the stalled socket would hold the thread up to its
        # send timeout: every answer comes well inside it
        assert worst < send_timeout_s / 4, worst
        deadline = time.monotonic() + 10
        while [s.producer for s in closed] != ["stalled"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s.producer for s in closed] == ["stalled"], "the producer that stopped reading stays"
        assert srv.counters_snapshot()["control_dropped"] == 1
    finally:
        reader.close()
        stalled.close()
        srv.close()


def test_control_sockets_keep_alive_on_both_sides(server):
    """A peer that vanished without a reset is found by TCP keepalive (25 s), not left
    to linger: the option is set on the producer's socket and on the consumer's."""
    from torch_kvops.control.protocol import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES

    c = client(server, "kept-alive")
    try:
        sockets = [c._sock] + list(server._sessions)
        assert len(sockets) == 2
        for sock in sockets:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == KEEPALIVE_INTERVAL_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
    finally:
        c.close()


# ---------------------------------------------------------------------- a held begin's fields

# A begin for a request the consumer does not expect yet is held for admission and read
# on the control thread's tick: each field checked there, outside the session that sent
# it, used to end that thread for every producer (issue 58).
MALFORMED_BEGINS = {
    "out_of_range": {"reqs": ["x"], "dst": {"x": [10 ** 9]}},
    "negative": {"reqs": ["x"], "dst": {"x": [-1]}},
    "not_integers": {"reqs": ["x"], "dst": {"x": [1.5, "2"]}},
    "dst_a_list": {"reqs": ["x"], "dst": [[1]]},
    "dst_null": {"reqs": ["x"], "dst": None},
    "blocks_a_dict": {"reqs": ["x"], "dst": {"x": {"1": 1}}},
    "reqs_not_a_list": {"reqs": "x", "dst": {}},
    "reqs_of_objects": {"reqs": [{"x": 1}], "dst": {}},
}


@pytest.mark.parametrize("case", sorted(MALFORMED_BEGINS) + ["control_well_formed"])
def test_a_malformed_begin_held_for_admission_drops_only_its_own_session(producer, case):
    conn, caches = producer
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE,
                               **dict(FAST, begin_waits_for_expect_s=0.2, accept_unsolicited_pushes=False))
    try:
        peer = conn.add_peer(consumer.info)  # a good producer, connected before
        intruder = ControlClient(consumer.info["control_address"], timeout_s=5.0, retries=0)
        intruder.connect()
        intruder.handshake(consumer.info["secret"], "intruder", staging=False)
        fields = MALFORMED_BEGINS.get(case, {"reqs": ["x"], "dst": {"x": [3]}})
        intruder.send(dict(op="begin", **fields))
        if case == "control_well_formed":  # held, then refused: nobody expected "x"
            answer = intruder.receive(5.0)
            assert answer is not None and (answer["op"], answer["rejected"]) == ("begun", ["x"]), answer
        else:
            with pytest.raises(ConnectionError, match="closed"):
                intruder.receive(5.0)  # its own session is dropped
        intruder.close()
        assert consumer.call("drain") == ([], []), "the consumer's control thread goes on"
        consumer.call("expect", ["good"])
        push_and_receive(conn, caches, consumer, TransferRequest("good", peer, [1, 2], [4, 5]))
        # and a producer that connects after it is answered
        other, other_caches, other_transport = make_producer()
        try:
            consumer.call("expect", ["later"])
            push_and_receive(other, other_caches, consumer,
                             TransferRequest("later", other.add_peer(consumer.info), [3], [6]))
        finally:
            other.close()
            other_transport.close()
    finally:
        consumer.stop()

"""SGLang prefill: a decode rank that drops every packet delays no other decode rank's
rooms (integrations/sglang/decode_peers.py, issue 35). Registrations are connected on
connect threads; the thread that reads P's ZMQ socket only hands them over. Real
producer connector and consumer process over the real Mooncake engine; the dropping
rank is an address in a network namespace this test creates, reached through a link
that drops every packet, so a connection to it hangs as across a real network. The
adapter's own calls are made as its receive thread makes them (under its handle lock);
SGLang itself is not needed for this part (tests/test_sglang_pd.py runs the backend in
real SGLang engines).

Negative control (``inline``): the connection made on the receive thread, as before
decode_peers.py: the healthy rank's room waits for every timeout and retry of the
dropping rank's connection.
"""
import threading
import time

import pytest

from torch_kvops.connector.breaker import PeerBreaker
from torch_kvops.integrations.sglang import decode_peers
from torch_kvops.integrations.sglang.decode_peers import HELD, DecodePeers
from torch_kvops.testing.consumer_process import ConsumerProcess

import test_decode_links
from test_decode_links import BLOCK_SHAPE, BLOCKS, CONFIG, LAYERS, _dropping_info

pytestmark = [pytest.mark.netns, pytest.mark.sglang]

# the fixtures of test_decode_links: a producer connector, an address that drops every packet
producer, dropping_address = test_decode_links.producer, test_decode_links.dropping_address

ROOM_BOUND_S = 1.0  # a healthy rank's room handled after its registration (alone: ~0.05 s)


class InlineExecutor:
    """The negative control: an attempt runs on the caller's thread."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def submit(self, fn, *args):
        fn(*args)

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def room_message(room: int, session: str) -> list:
    """A destination message as D sends it (manager.build_receiver_metadata_message)."""
    return [str(room).encode(), b"127.0.0.1", b"1", session.encode(), b"\x01\x00\x00\x00", b"0", b"1", b"0"]


@pytest.mark.parametrize("case", ["background", "inline"])
def test_a_dropping_decode_rank_delays_no_other_ranks_rooms(case, producer, dropping_address, monkeypatch):
    if case == "inline":
        monkeypatch.setattr(decode_peers, "ThreadPoolExecutor", InlineExecutor)
    good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    handle_lock = threading.RLock()  # as the manager's
    handled, failed = {}, {}
    peers = None

    def replay(msg):  # what the manager does with a room whose rank is now connected
        handled[int(msg[0])] = (peers.peer(msg[3].decode(), msg), time.monotonic())

    def fail(room, reason):
        failed[room] = (reason, time.monotonic())

    attempts = []  # engine ids add_peer was called for
    add_peer = producer.add_peer
    monkeypatch.setattr(producer, "add_peer", lambda info: attempts.append(info["engine_id"])
                        or add_peer(info))
    now = [0.0]  # the breaker's clock: the backoff after a failed attempt passes when told
    peers = DecodePeers(producer, handle_lock, replay, fail, PeerBreaker(clock=lambda: now[0]))
    dropping = _dropping_info(good.info, dropping_address)
    try:
        started = time.monotonic()
        with handle_lock:  # the receive thread: the dropping rank registers, then the healthy one
            peers.register("dropping", dropping)
            registered = time.monotonic() - started
            peers.register("dropping", dict(dropping))  # again, while its attempt runs
            peers.register("good", good.info)
            if case == "inline":  # its attempts ran (and failed) in register: back off no more
                now[0] += 60.0
            assert peers.peer("dropping", room_message(1, "dropping")) == HELD
            assert peers.peer("unknown", room_message(3, "unknown")) is None, "an unregistered rank"
        if case == "background":  # P owes the held room: its owed notices renew its lease on D
            assert peers.held_rooms() == {"tcp://127.0.0.1:1": [1]}
        with handle_lock:
            peer = peers.peer("good", room_message(2, "good"))
            if peer != HELD:
                handled[2] = (peer, time.monotonic())
        deadline = time.monotonic() + 3 * CONFIG["control_timeout_s"] + 5.0
        while (2 not in handled or 1 not in failed) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 2 in handled and 1 in failed, (handled, failed)
        good_peer, good_at = handled[2]
        reason, failed_at = failed[1]
        print(f"{case}: registration returned after {registered:.3f} s; the healthy rank's room "
              f"was handled after {good_at - started:.3f} s; the dropping rank's failed after "
              f"{failed_at - started:.2f} s")
        assert good_peer not in (None, HELD) and "could not be connected" in reason, (good_peer, reason)
        if case == "inline":  # the control: the healthy rank waited for the dropping one
            assert good_at - started >= CONFIG["control_timeout_s"]
            return
        # an inline connection holds registration for the whole connect timeout (the
        # control's case): a quarter of it is far more than handing one over takes
        assert registered < CONFIG["control_timeout_s"] / 4, \
            f"registering the dropping rank held the receive thread {registered:.2f} s"
        assert good_at - started < ROOM_BOUND_S, f"the healthy rank's room waited {good_at - started:.2f} s"
        assert failed_at - started >= CONFIG["control_timeout_s"]  # its attempt ran its course
        assert attempts.count(dropping["engine_id"]) == 1, attempts  # one attempt at a time
        assert peers.held_rooms() == {}, "a failed room is owed no more"
        # its next room fails at once while the rank backs off (no attempt that would
        # only time out again); once the backoff passed, a room asks for another attempt
        # and is held meanwhile
        with handle_lock, pytest.raises(RuntimeError, match="connecting again in"):
            peers.peer("dropping", room_message(4, "dropping"))
        assert attempts.count(dropping["engine_id"]) == 1, attempts
        now[0] += 1.0  # past the first backoff (0.25-0.5 s)
        with handle_lock:
            assert peers.peer("dropping", room_message(6, "dropping")) == HELD
        with handle_lock:
            assert peers.peer("good", room_message(5, "good")) == good_peer
    finally:
        started = time.monotonic()
        peers.close()
        assert time.monotonic() - started < 2 * CONFIG["control_timeout_s"] + 2.0
        good.stop()

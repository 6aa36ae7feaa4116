"""A prefill instance with data parallelism (issue 34), its side channel and bootstrap
endpoint (real sockets and threads, loopback): each DP rank's side channel on its own
port, rank 0's ``GET /query`` listing every rank once the others registered (signed
with the fleet key; an unsigned registration is refused), and D's destination posted to
the rank the router named by engine id (``remote_engine_id``), never to another rank.
The same with real ``vllm serve --data-parallel-size 2``: tests/test_vllm_dp.py."""
import json
import threading
import urllib.request

import pytest

from torch_kvops.integrations.vllm.params import decode_params
from torch_kvops.integrations.vllm.side_channel import DestinationPoster, DestinationServer, FleetAuth
from torch_kvops.integrations.vllm.side_channel.bootstrap import BootstrapServer, rank_entry
from torch_kvops.integrations.vllm.side_channel.dp_rank import RankRegistration, side_channel_port

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

KEY = bytes(range(32))


def _query(url):
    with urllib.request.urlopen(url + "/query", timeout=5) as response:
        return json.loads(response.read())


class _Answers:
    def __init__(self):
        self.items, self.cond = {}, threading.Condition()

    def __call__(self, tid, answer):
        with self.cond:
            self.items[tid] = answer
            self.cond.notify_all()

    def wait(self, tid):
        with self.cond:
            assert self.cond.wait_for(lambda: tid in self.items, timeout=10), f"no outcome for {tid}"
            return self.items[tid]


def test_side_channel_ports_follow_the_dp_rank():
    assert [side_channel_port(8999, r) for r in range(3)] == [8999, 9000, 9001]
    assert side_channel_port(0, 0) == 0
    with pytest.raises(ValueError, match="fixed side_channel_port"):
        side_channel_port(0, 1)
    with pytest.raises(ValueError, match="not a port"):
        side_channel_port(65535, 1)


def test_every_dp_rank_is_listed_and_d_posts_to_the_rank_named():
    ranks = [DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 1}, auth=FleetAuth(KEY)) for _ in range(2)]
    entries = [rank_entry(f"eng_dp{r}", s.address, 1, signed=True, tls=False) for r, s in enumerate(ranks)]
    boot = BootstrapServer("127.0.0.1", 0, entries[0], auth=FleetAuth(KEY))
    port = int(boot.address.rsplit(":", 1)[1])
    answers = _Answers()
    poster = DestinationPoster(answers, timeout_s=1.0, retries=0, auth=FleetAuth(KEY))
    registrations = []
    try:
        # without the fleet key, a registration is refused: /query is not redirected
        stranger = RankRegistration("127.0.0.1", port, 1, rank_entry("evil_dp1", "127.0.0.1:1", 1, signed=False,
                                                                      tls=False), auth=None)
        registrations.append(stranger)
        assert not stranger.registered.wait(1.5)
        assert list(_query(boot.url)) == ["0"]
        genuine = RankRegistration("127.0.0.1", port, 1, entries[1], auth=FleetAuth(KEY))
        registrations.append(genuine)
        assert genuine.registered.wait(10)
        listed = _query(boot.url)
        assert {k: v["engine_id"] for k, v in listed.items()} == {"0": "eng_dp0", "1": "eng_dp1"}
        assert listed["1"]["kvops"]["side_channel"] == ranks[1].address
        # the router's params name rank 1: D's post reaches rank 1's side channel only
        for rank in (1, 0):
            tid = f"on-rank-{rank}"
            params = decode_params({"do_remote_prefill": True, "transfer_id": tid,
                                    "remote_bootstrap_addr": boot.url, "remote_engine_id": f"eng_dp{rank}"})
            poster.post(params.post_to, {"transfer_id": tid, "block_ids": [4, 5], "start_token": 0,
                                         "peers": [{"engine_id": "d"}]})
            assert answers.wait(tid) is not None, f"rank {rank} did not accept"
            assert ranks[rank].take(tid) is not None and ranks[1 - rank].take(tid) is None
        # an engine id of no rank: refused, never posted to some other rank
        params = decode_params({"do_remote_prefill": True, "transfer_id": "nowhere",
                                "remote_bootstrap_addr": boot.url, "remote_engine_id": "eng_dp7"})
        poster.post(params.post_to, {"transfer_id": "nowhere", "block_ids": [4], "start_token": 0,
                                     "peers": [{"engine_id": "d"}]})
        assert answers.wait("nowhere") is None
        assert poster.counters()["bad_answer"] == 1
        assert all(r.take("nowhere") is None for r in ranks)
    finally:
        for registration in registrations:
            registration.close()
        poster.close()
        boot.close()
        for server in ranks:
            server.close()


def test_a_one_rank_instance_is_found_whatever_engine_id_the_router_sent():
    """Before data parallelism, D ignored remote_engine_id: a router or proxy that sends
    another id (or none) still reaches an instance of one rank."""
    server = DestinationServer("127.0.0.1", 0, facts={"prefill_tp": 1})
    boot = BootstrapServer("127.0.0.1", 0, rank_entry("p", server.address, 1, signed=False, tls=False), auth=None)
    answers = _Answers()
    poster = DestinationPoster(answers, timeout_s=1.0, retries=0)
    try:
        for tid, engine in (("a", "other"), ("b", None)):
            params = decode_params({"do_remote_prefill": True, "transfer_id": tid,
                                    "remote_bootstrap_addr": boot.url, "remote_engine_id": engine})
            poster.post(params.post_to, {"transfer_id": tid, "block_ids": [1], "start_token": 0,
                                         "peers": [{"engine_id": "d"}]})
            assert answers.wait(tid) is not None and server.take(tid) is not None
    finally:
        poster.close()
        boot.close()
        server.close()

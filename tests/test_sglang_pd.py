"""SGLang P/D with this package's transfer backend, the gate's SGLang fleet: real SGLang
0.5.23 servers (``python -m sglang.launch_server --disaggregation-mode prefill|decode
--disaggregation-transfer-backend kvops``, CPU) behind SGLang's router
(``sglang-router`` 0.3.2, P/D mode), against a monolithic SGLang server
(tests/sglang_pd.py).

Two prefill servers and one decode server (2P1D), 16 prompts at once, pages of 16
tokens; one prefill server prefills in chunks of 256 tokens, so most of its rooms leave
in several chunks. SGLang's decode server never computes a prompt: it decodes from the
KV the prefill server sent. So answers equal to the reference mean the KV arrived whole
and in place, and the negative control (P's transport moves no byte, with D's checks
switched off) shows that the answers depend on those bytes. One fault: D SIGKILLed
while P pushes fails only its own requests, every page on the prefill servers comes
back, and the restarted D serves again. The only stand-in is tests/sglang_standin (two
CPU kernels of sgl_kernel that have no wheel on PyPI), labelled there.

The fleet runs as a fleet beyond one host would: every server holds the fleet key
(control-channel secrets derived from it, the backend's ZMQ messages signed with it)
and D checks every layer with the integrity check's ``mac`` mode. The same fleet's
other checks (the other sabotages with D's checks on and off, a prefill server with
another key, owed-room notices, aborts, the other faults) are
tests/test_sglang_pd_checks.py's, in `make test-full` and `make test-sglang`.
"""
from __future__ import annotations

import pytest

from torch_kvops.serving import prometheus

from sglang_fleet import LANDED_IN_FORWARD, count
from sglang_pd import (a_fault_fails_only_its_own_requests, compare,
                       misplaced_or_dropped_kv_changes_the_answers, pd_fleet)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]


@pytest.fixture(scope="module")
def fleet():
    with pd_fleet(foreign=False) as fleet:
        yield fleet


def test_router_answers_equal_the_monolithic_server_and_prefill_pushes_layer_by_layer(fleet):
    servers = fleet.servers
    assert compare(fleet, seed=1, n=16) == []
    assert compare(fleet, seed=2, n=16) == []  # the pages of the first load are reused
    p1, p2, d = (prometheus.fetch(servers[name].url) for name in ("P1", "P2", "D"))
    # the router spread the rooms over both prefill servers; each reached D whole
    rooms = [count(p, "rooms", label="success") for p in (p1, p2)]
    assert min(rooms) >= 8 and sum(rooms) >= 32, rooms
    assert count(d, "rooms", label="success") >= 32
    # D computed no prompt token: SGLang's own prefill counter on D stays at 0 (P's counts)
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input")
                 for s in (p1, p2, d)]
    assert prefilled[2] == 0 and min(prefilled[:2]) > 0, prefilled
    assert not any(count(s, "rooms", label="failed") for s in (p1, p2, d))
    # rooms waited in the prefill queues; their leases were renewed while they did
    assert count(d, "lease_renewals") > 0
    # every chunk left in its forward, layer by layer (SGLang starts a prefill once its
    # destination is known); none waited for the forward's end
    for p in (p1, p2):
        assert count(p, "chunks", label="after_forward") == 0
    # P1's rooms left in more chunks than rooms (prefill chunked by 256 tokens)
    assert count(p1, "chunks", label="forward") > rooms[0] + 8
    layers = sum(count(p, "layers") for p in (p1, p2))
    early = sum(count(p, "layers_landed_during_forward") for p in (p1, p2))
    print(f"\n[sglang] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    # most layers land while later ones compute
    assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)


@pytest.mark.parametrize("mode", ["drop"])
def test_negative_control_misplaced_or_dropped_kv_changes_the_answers(fleet, mode):
    """tests/sglang_pd.py: misplaced_or_dropped_kv_changes_the_answers."""
    misplaced_or_dropped_kv_changes_the_answers(fleet, mode)


@pytest.mark.parametrize("fault", ["kill_decode"])
def test_a_fault_fails_only_its_own_requests_and_every_page_comes_back(fleet, fault):
    """tests/sglang_pd.py: a_fault_fails_only_its_own_requests."""
    a_fault_fails_only_its_own_requests(fleet, fault)

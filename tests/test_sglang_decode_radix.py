"""SGLang P/D with the decode side's radix cache (``--disaggregation-decode-enable-radix-cache``)
and the ``kvops`` backend: real SGLang 0.5.23 servers behind sglang-router (P/D mode),
against a monolithic SGLang server, with multi-turn conversations (each turn's prompt is
the last one, its answer and a few more words).

D keeps each finished request's KV in its radix cache and, for a prompt that begins with
one it holds, asks P for the rest only: its destination names pages past that prefix,
and SGLang's prefill counts the pages it sends from there. Before stop 51 the forward's
layer-wise push began at the prompt's first page, and every such room failed ("16
source blocks but 1 destination blocks"): the second turn of a conversation got HTTP 500.

P (chunks of 256 tokens), D and the reference at TP 1, pages of 16 tokens; the fleet
key and D's ``mac`` integrity check.
"""
from __future__ import annotations

from typing import List, Tuple

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (PAGE_SIZE, ROUTER_CHECKS, answers, count, fleet_env, pages_come_back,
                          random_prompts, router_serves_again, sabotage_changes_the_answers, serving)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]

CHUNK = 256  # P's --chunked-prefill-size
DECODE_RADIX = ["--disaggregation-decode-enable-radix-cache"]
EARLY_SEND = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "1"}


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-decode-radix") as (tmp, model, log_dir, sabotage):
        same = dict(env=fleet_env(tmp), page_size=PAGE_SIZE)
        with Servers(log_dir) as servers:
            # SGLang's early send of a cached prefix (its default; the launcher turns it
            # off: with the overlap schedule it records a torch.cuda.Event)
            p = servers.add(SglangServerSpec("P", model, role="prefill", page_size=PAGE_SIZE,
                                             env=dict(same["env"], **EARLY_SEND),
                                             extra_args=["--chunked-prefill-size", str(CHUNK),
                                                         "--disable-overlap-schedule"]))
            d = servers.add(SglangServerSpec("D", model, role="decode", extra_args=DECODE_RADIX, **same))
            d2 = servers.add(SglangServerSpec("D2", model, role="decode", **same))  # no radix cache
            servers.add(SglangServerSpec("ref", model, role="monolithic", **same))
            servers.add(SglangRouterSpec("router", [p], [d], extra_args=ROUTER_CHECKS))
            servers.add(SglangRouterSpec("router2", [p], [d2], extra_args=ROUTER_CHECKS))
            with serving(servers, ["P", "D", "D2", "ref"]):
                servers.start(["router2"], 600)
                router_serves_again(servers, model)
                router_serves_again(servers, model, router="router2")
                yield servers, model, sabotage


def _turn(fleet, prompts: List[str], router: str = "router") -> Tuple[List[int], List[str], List[str]]:
    """(indices where the answer of ``router`` differs from the reference's, its
    answers, the reference's) for ``prompts`` sent at once."""
    servers, model, _ = fleet
    reference = answers(servers["ref"].url, model, prompts)
    assert not [a for a in reference if a.startswith("<")], reference
    got = answers(servers[router].url, model, prompts)
    return [i for i, (a, r) in enumerate(zip(got, reference)) if a != r], got, reference


def _next_turn(prompts: List[str], reference: List[str], turn: int, words: int = 3) -> List[str]:
    """Each prompt, its answer, and ``words`` more words."""
    tail = "".join(f" w{(100 * (k + 1) + turn) % 1000}" for k in range(words))
    return [p + a + tail for p, a in zip(prompts, reference)]


def _skipped(servers) -> float:
    return count(servers["P"].metrics(), "decode_prefix_tokens")


def test_conversations_equal_the_reference_and_only_what_decode_lacks_is_sent(fleet):
    """6 conversations of 3 turns, each turn's 6 prompts at once: every answer equals the
    reference's; from the second turn on D holds most of each prompt, and P sends only
    the rest (counted as tokens skipped), in the forward, layer by layer; no room fails,
    D computes no prompt token, and P's pages come back."""
    servers = fleet[0]
    prompts = random_prompts(seed=60, n=6)
    before = prometheus.fetch(servers["P"].url)
    skipped, previous = [_skipped(servers)], []
    for turn in range(3):
        differ, got, reference = _turn(fleet, prompts)
        assert differ == [], [got[i][:120] for i in differ]
        skipped.append(_skipped(servers))
        if turn:
            # D holds at least the previous turn's prompt, less its partial last page
            held = sum(len(p.split()) for p in previous) - 16 * len(prompts)
            print(f"\n[sglang decode radix] turn {turn + 1}: {skipped[-1] - skipped[-2]:.0f} prompt "
                  f"tokens held by D and not sent (the previous turn's prompts: >= {held} tokens)")
            assert skipped[-1] - skipped[-2] >= held, skipped
        previous, prompts = prompts, _next_turn(prompts, reference, turn)
    assert skipped[1] == skipped[0]  # the first turn: nothing held
    p, d = prometheus.fetch(servers["P"].url), prometheus.fetch(servers["D"].url)
    rooms = count(p, "rooms", label="success") - count(before, "rooms", label="success")
    assert rooms == 18 and not any(count(s, "rooms", label="failed") for s in (p, d))
    assert count(p, "chunks", label="after_forward") == 0  # every chunk in its forward
    assert prometheus.total(d, "sglang:prefill_effective_tokens_total", mode="input") == 0
    pages_come_back(servers, ["P"])


def test_negative_control_the_rest_not_moved_changes_the_answers(fleet):
    """Second turns (48 more words) whose rest, past D's prefix, moves no byte (``drop``),
    with D's checks off: the answers differ, so what P sends past the prefix is what D
    reads. (Without the keys of layer 1 only, and 3 more words, 3 of 8 differed: too
    few tokens past the prefix for a reliable control.)"""
    first = random_prompts(seed=61, n=8)
    differ, _, reference = _turn(fleet, first)
    assert differ == []
    second = _next_turn(first, reference, 1, words=48)
    sabotage_changes_the_answers(fleet[2], ("drop", "unverified", "unchecked"),
                                 lambda: _turn(fleet, second)[:2])


def test_negative_control_a_push_that_ignores_the_prefix_fails_its_rooms(fleet):
    """The forward's push without D's prefix (``ignore_decode_prefix``, as before stop
    51): the second turns fail (P's pages outnumber D's destination), then the fleet
    answers right again. So the prefix is what the first test's rooms ran with."""
    servers, model, sabotage = fleet
    first = random_prompts(seed=62, n=8)
    differ, _, reference = _turn(fleet, first)
    assert differ == []
    failed = count(servers["P"].metrics(), "rooms", label="failed")
    sabotage.set("ignore_decode_prefix")
    try:
        differ, got, _ = _turn(fleet, _next_turn(first, reference, 1))
    finally:
        sabotage.set()
    # a room whose prefix P holds longer than D goes whole by the push thread, cut
    # as SGLang cuts it (the early send, below): it answers right (1 of 4, 1 of 8 seen)
    print(f"\n[sglang decode radix] prefix ignored: {len(differ)} of 8 failed")
    assert len(differ) >= 6 and all(got[i].startswith("<") for i in differ), got
    assert count(servers["P"].metrics(), "rooms", label="failed") - failed >= 3
    router_serves_again(servers, model)
    assert _turn(fleet, random_prompts(seed=63, n=4))[0] == []


def _rooms(servers, names=("P", "D2")) -> List[float]:
    return [count(servers[n].metrics(), "rooms", label=outcome) for n in names
            for outcome in ("success", "failed")]


def test_a_prefix_the_prefill_holds_leaves_before_its_forward_and_the_rest_after_it(fleet):
    """To D2 (no radix cache), prompts whose first part P holds cached: SGLang sends
    those pages before the forward that computes the rest (its early send), and the
    push thread then sends the rest after that forward, in order. Every answer equals
    the reference's and no room fails (before stop 51 the forward pushed the whole
    room, whose last chunk ended it first: in a run by hand of 12 requests, 5 rooms
    failed on P)."""
    servers = fleet[0]
    first = random_prompts(seed=64, n=4)
    assert _turn(fleet, first, "router2")[0] == []
    before, chunks = _rooms(servers), count(servers["P"].metrics(), "chunks", label="after_forward")
    differ, got, _ = _turn(fleet, _next_turn(first, [""] * 4, 1, words=40), "router2")
    assert differ == [], [got[i][:120] for i in differ]
    after = _rooms(servers)
    print(f"\n[sglang early send] rooms (P ok, P failed, D2 ok, D2 failed): {before} -> {after}")
    assert [b - a for a, b in zip(before, after)] == [4, 0, 4, 0]
    # the early chunk and the rest, each by the push thread
    assert count(servers["P"].metrics(), "chunks", label="after_forward") - chunks >= 8


def test_negative_control_an_early_sent_prefix_dropped_changes_the_answers(fleet):
    """The same with no byte moved (``drop``, D2's checks off): the answers differ."""
    first = random_prompts(seed=65, n=8)
    assert _turn(fleet, first, "router2")[0] == []
    second = _next_turn(first, [""] * 8, 1, words=40)
    sabotage_changes_the_answers(fleet[2], ("drop", "unverified", "unchecked"),
                                 lambda: _turn(fleet, second, "router2")[:2])

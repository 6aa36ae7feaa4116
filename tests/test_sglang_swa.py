"""SGLang P/D of a sliding-window model with the ``kvops`` backend: real SGLang 0.5.23
servers behind sglang-router (P/D mode), against a monolithic SGLang server, with the
test Mellum (torch_kvops/testing/swa_model.py: layers alternate a 64-token sliding
window and full attention; prompts of 50-800 tokens).

SGLang gives such a model a hybrid pool by default: full layers in one pool, sliding
layers' last window in another, smaller one (a state pool, ``StateType.SWA``). The
backend moves it (swa_pool.py): the full layers' pages in the forward, and each
room's window, a transfer of its own, in its last chunk's forward (P-hybrid,
D-hybrid). With
``--disable-hybrid-swa-memory`` every layer is in the one KV pool (a sliding layer
keeps every token, its attention still masked to the window), so P pushes each
layer's pages as its forward writes them, of a sliding layer its window's only.

P (chunks of 256 tokens), D and the monolithic reference run with that flag, and the
reference's answers equal Hugging Face ``transformers``' own Mellum (greedy). The
hybrid pair runs a test-only stand-in (tests/sglang_standin/cpu_swa_reads.py): SGLang
0.5.23's ``torch_native`` attention writes a sliding layer's KV at the window pool's
slots but reads it at the full pool's, and 11 of 12 answers of a monolithic server
differ from transformers' without it (0 of 12 with it, by hand). The fleet key and
D's ``mac`` integrity check.

Not in the suite since 2026-11-29, for CI's 90 minutes (docs/sglang.md keeps their
results): a by-head pair (``"mha_unit": "head"``) moving windows only, and a fleet that
mixes the two units failing its rooms alone; the TP 2 prefill server's windows.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from typing import Dict, List

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.model import random_prompt
from torch_kvops.testing.swa_model import swa_model_config
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec, sglang_python

from serving_fleet import workspace
from sglang_sabotage import serving_env
from sglang_fleet import (LANDED_IN_FORWARD, MAX_TOKENS, PAGE_SIZE, ROUTER_CHECKS, answers, count,
                          differ_from_reference, fleet_env, pages_come_back, random_prompts,
                          router_serves_again, sabotage_changes_the_answers, serving)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]

CHUNK = 256  # P's --chunked-prefill-size
ONE_POOL = ["--disable-hybrid-swa-memory"]
DECODE_RADIX = "--disaggregation-decode-enable-radix-cache"
HF_GREEDY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_greedy.py")


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-swa", swa=True) as (tmp, model, log_dir, sabotage):
        same = dict(env=fleet_env(tmp), page_size=PAGE_SIZE)
        with Servers(log_dir) as servers:
            p = servers.add(SglangServerSpec("P", model, role="prefill",
                                             extra_args=ONE_POOL + ["--chunked-prefill-size", str(CHUNK)],
                                             **same))
            d = servers.add(SglangServerSpec("D", model, role="decode", extra_args=ONE_POOL, **same))
            servers.add(SglangServerSpec("ref", model, role="monolithic", extra_args=ONE_POOL, **same))
            servers.add(SglangRouterSpec("router", [p], [d], extra_args=ROUTER_CHECKS))
            # started by their tests only: a prefill and a decode server with SGLang's
            # hybrid pool, behind a router of their own; a decode server with its radix
            # cache, behind a router of its own
            hybrid = dict(same, env=dict(same["env"], **serving_env(os.path.join(tmp, "plugin-hybrid"),
                                                                    "cpu_swa_reads")))
            p_hybrid = servers.add(SglangServerSpec("P-hybrid", model, role="prefill", extra_args=[
                "--chunked-prefill-size", str(CHUNK)], **hybrid))
            d_hybrid = servers.add(SglangServerSpec("D-hybrid", model, role="decode", **hybrid))
            servers.add(SglangRouterSpec("router-hybrid", [p_hybrid], [d_hybrid], extra_args=ROUTER_CHECKS))
            d_radix = servers.add(SglangServerSpec("D-radix", model, role="decode",
                                                   extra_args=ONE_POOL + [DECODE_RADIX], **same))
            servers.add(SglangRouterSpec("router-radix", [p], [d_radix], extra_args=ROUTER_CHECKS))
            with serving(servers, ["P", "D", "ref"]):
                yield servers, model, sabotage


_reference: Dict[str, str] = {}


def _differ(fleet, seed: int, n: int = 8, router: str = "router"):
    servers, model, _ = fleet
    return differ_from_reference(servers, model, seed, n, f"sglang swa {router}", _reference, router)


def _transformers_answers(model: str, prompts: List[str]) -> List[List[str]]:
    out = subprocess.run([sglang_python(), HF_GREEDY, model, str(MAX_TOKENS)], input=json.dumps(prompts),
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return [a.split() for a in json.loads(out)]


def test_the_reference_answers_as_transformers_does_and_from_its_context(fleet, tmp_path):
    """The monolithic server's answers equal Hugging Face ``transformers``' greedy ones
    (an engine-independent reference of the sliding window); negative control, the same
    model with no window in transformers (every layer full): the answers differ, so
    the window is part of what is compared. Prompts that share their last words but not
    what comes before answer differently: a transfer that moved no KV could not give
    the reference's answers. No server of the fleet runs the hybrid pool."""
    servers, model, _ = fleet
    prompts = random_prompts(seed=40, n=4)
    got = [a.split() for a in answers(servers["ref"].url, model, prompts)]
    assert got == _transformers_answers(model, prompts)
    windowless = tmp_path / "windowless"
    shutil.copytree(model, windowless)
    config = json.loads((windowless / "config.json").read_text())
    config["sliding_window"] = config["max_position_embeddings"]
    (windowless / "config.json").write_text(json.dumps(config))
    unlike = [i for i, a in enumerate(_transformers_answers(str(windowless), prompts)) if a != got[i]]
    assert len(unlike) >= 3, f"without its window the model answers the same to {4 - len(unlike)} of 4"
    tail = " w500 w501 w502"
    with_tail = answers(servers["ref"].url, model, [p + tail for p in prompts])
    assert not [a for a in with_tail if a.startswith("<")], with_tail
    assert len(set(with_tail)) == len(with_tail), with_tail
    assert not any("Use sliding window memory pool" in open(servers[n].log_path).read()
                   for n in ("P", "D", "ref"))


def test_router_answers_equal_the_monolithic_server_and_prefill_pushes_each_layer_in_its_forward(fleet):
    servers = fleet[0]
    n = 12
    assert _differ(fleet, seed=41, n=n)[0] == []
    p, d = (prometheus.fetch(servers[name].url) for name in ("P", "D"))
    assert count(p, "rooms", label="success") >= n and count(d, "rooms", label="success") >= n
    assert not any(count(s, "rooms", label="failed") for s in (p, d))
    # D computed no prompt token: SGLang's own prefill counter on D stays at 0
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input") for s in (p, d)]
    assert prefilled[1] == 0 and prefilled[0] > 0, prefilled
    # every chunk left in its forward, in more chunks than rooms (chunked prefill)
    assert count(p, "chunks", label="after_forward") == 0
    assert count(p, "chunks", label="forward") > n
    layers, early = count(p, "layers"), count(p, "layers_landed_during_forward")
    print(f"\n[sglang swa] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)
    _windows_left_bytes_on_p(p)
    pages_come_back(servers, ["P", "D"])


def _windows_left_bytes_on_p(p: prometheus.Samples) -> None:
    """The sliding layers' pages before their window stayed on P (windows.py): half
    the layers slide; prompts of 50-800 tokens, windows of 64: about 40% fewer bytes."""
    config = swa_model_config()
    page_bytes = PAGE_SIZE * config["num_key_value_heads"] * config["head_dim"] * 4  # float32
    left, pushed = count(p, "window_pages_skipped") * page_bytes, count(p, "pushed_bytes")
    print(f"[sglang swa] {left:.0f} bytes of sliding layers' pages before their windows left on P, "
          f"{pushed:.0f} pushed: {left / (left + pushed):.1%} fewer")
    assert left >= 0.3 * (left + pushed), (left, pushed)


def test_negative_control_a_window_pushed_short_changes_the_answers(fleet):
    """P takes each sliding layer's window as a quarter of its size (``short_window``):
    the pages of the window's first three quarters are not pushed, and D reads what
    its pages held before. D's checks stay on (they vouch for the pages pushed): the
    answers differ, so the window P pushes is the one D reads."""
    servers = fleet[0]
    before = count(prometheus.fetch(servers["P"].url), "window_pages_skipped")
    sabotage_changes_the_answers(fleet[2], ("short_window",), lambda: _differ(fleet, 45))
    assert count(prometheus.fetch(servers["P"].url), "window_pages_skipped") > before
    assert _differ(fleet, seed=46, n=4)[0] == []  # and the fleet is whole again


@pytest.mark.parametrize("mode", ["drop_layer", "drop_layer0"])
def test_negative_control_a_missing_full_or_sliding_layer_changes_the_answers(fleet, mode):
    """The keys of layer 1 (full attention: ``drop_layer``) or of layer 0 (a 64-token
    sliding window: ``drop_layer0``) move no byte, with D's checks off (``unverified``,
    ``unchecked``): the answers differ, so each kind of layer's KV is what D reads."""
    seed = {"drop_layer": 42, "drop_layer0": 43}[mode]
    sabotage_changes_the_answers(fleet[2], (mode, "unverified", "unchecked"), lambda: _differ(fleet, seed))
    assert _differ(fleet, seed=44, n=4)[0] == []  # and the fleet is whole again


def test_the_hybrid_pool_moves_full_pages_and_each_window_layer_by_layer_in_the_forward(fleet):
    """SGLang's hybrid pool on P and D (its default for this model): 8 prompts at once,
    every answer equal to the reference's, no room failed, D computed no prompt token,
    every chunk of the full layers and each room's window left in their forwards,
    layer by layer (none after: SGLang named the same window pages after the forward).
    Negative control, in the suite: the windows' bytes dropped (``drop_window``), D's
    checks off: the answers differ; the fleet answers right again and every page comes
    back on both sides."""
    servers, model, sabotage = fleet
    servers.start(["P-hybrid", "D-hybrid"], 600)
    servers.start(["router-hybrid"], 600)
    try:
        for name in ("P-hybrid", "D-hybrid"):
            with open(servers[name].log_path) as f:
                assert "a hybrid pool's 4 sliding buffers" in f.read()
        router_serves_again(servers, model, router="router-hybrid")
        n = 8
        assert _differ(fleet, seed=53, n=n, router="router-hybrid")[0] == []
        p, d = (prometheus.fetch(servers[name].url) for name in ("P-hybrid", "D-hybrid"))
        assert count(p, "rooms", label="success") >= n and count(d, "rooms", label="success") >= n
        assert not any(count(s, "rooms", label="failed") for s in (p, d))
        prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input") for s in (p, d)]
        assert prefilled[1] == 0 and prefilled[0] > 0, prefilled
        assert count(p, "chunks", label="after_forward") == 0 and count(p, "chunks", label="window") == 0
        assert count(p, "chunks", label="forward") > 2 * n  # the rooms' chunks and their windows
        layers, early = count(p, "layers"), count(p, "layers_landed_during_forward")
        print(f"\n[sglang swa hybrid] {count(p, 'chunks', label='forward'):.0f} chunks and windows pushed "
              f"in forwards, {count(p, 'pushed_bytes'):.0f} bytes; {early:.0f} of {layers:.0f} pushed "
              "buffers landed before their forward ended")
        assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)
        differ = sabotage_changes_the_answers(sabotage, ("drop_window", "unverified", "unchecked"),
                                              lambda: _differ(fleet, 54, router="router-hybrid"))
        print(f"[sglang swa hybrid] windows dropped: {len(differ)} of 8 answers differ")
        assert _differ(fleet, seed=55, n=4, router="router-hybrid")[0] == []  # and whole again
        pages_come_back(servers, ["P-hybrid", "D-hybrid"])
    finally:  # their health checks would load the machine for the rest of the module
        for name in ("router-hybrid", "P-hybrid", "D-hybrid"):
            servers[name].stop()


def _shared_starts(fleet, seed: int, n: int = 6) -> List[int]:
    """Through the router to the decode server with its radix cache: ``n`` prompts of
    600 words, then ``n`` that begin with the first 320 words of one of them and end
    with 10 words of their own. D holds those 320 tokens (its radix cache) and P sends
    the rest; D's last sliding window of each reaches back 53 tokens into that prefix,
    which lay before the window of the first prompt. The indices of the second
    prompts whose answers differ from the reference's."""
    servers, model, _ = fleet
    rng = random.Random(seed)
    firsts = [random_prompt(600, 1024, rng) for _ in range(n)]
    seconds = [" ".join(p.split()[:320] + random_prompt(10, 1024, rng).split()) for p in firsts]
    differ = {}
    for which, prompts in (("first", firsts), ("second", seconds)):
        got = answers(servers["router-radix"].url, model, prompts)
        reference = answers(servers["ref"].url, model, prompts)
        assert not [a for a in reference if a.startswith("<")], reference
        differ[which] = [i for i, (a, r) in enumerate(zip(got, reference)) if a != r]
    assert differ["first"] == [], differ  # a prompt D holds nothing of: its windows suffice
    differ = differ["second"]
    print(f"\n[sglang swa] seed {seed}: {len(differ)} of {n} second prompts answer otherwise")
    return differ


def test_a_decode_server_with_its_radix_cache_gets_every_page_of_the_sliding_layers(fleet):
    """A D with its radix cache reads a finished prompt's pages again for a later prompt
    that begins with it, the sliding layers' pages before that prompt's window too: P
    pushes it every page (D says so when it registers; windows.py). Every answer equals
    the reference's, and D held the shared starts. Negative control, in the suite: P
    pushes D the windows only anyway (``window_to_caching_decode``): the second prompts
    answer otherwise."""
    servers, model, sabotage = fleet
    servers.start(["D-radix", "router-radix"], 600)
    try:
        router_serves_again(servers, model, router="router-radix")
        held = count(prometheus.fetch(servers["P"].url), "decode_prefix_tokens")
        assert _shared_starts(fleet, seed=47) == []
        assert count(prometheus.fetch(servers["P"].url), "decode_prefix_tokens") >= held + 6 * 320
        sabotage.set("window_to_caching_decode")
        try:
            differ = _shared_starts(fleet, seed=48)
        finally:
            sabotage.set()
        assert len(differ) >= 4, f"only second prompts {differ} of 6 answered otherwise"
        assert _shared_starts(fleet, seed=49, n=2) == []  # and whole again
    finally:  # their health checks would load the machine for the rest of the module
        for name in ("router-radix", "D-radix"):
            servers[name].stop()

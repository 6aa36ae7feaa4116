"""`make demo`'s comparison (disaggregated tokens against the monolithic run) and its
negative control: the same demo with the producer's writes dropped must report a
mismatch and exit 1. Small model, eager only, one round; on plain loopback in-process
(the sabotage patches this process), and once inside the emulated link `make demo`
uses by default."""
import json
import subprocess
import sys

import pytest

from torch_kvops import demo
from torch_kvops.transports.mooncake import MooncakeTransport

pytestmark = [pytest.mark.netns]

SMALL = ["--layers", "4", "--prompt-len", "256", "--repeats", "1", "--new-tokens", "4", "--no-compile",
         "--link", "none"]


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(demo, "print_report", lambda result: None)


def test_demo_tokens_match_the_monolithic_run():
    assert demo.main(SMALL) == 0


@pytest.mark.parametrize("how", ["drop", "shift"])
def test_demo_fails_when_the_transfer_is_sabotaged(monkeypatch, capsys, how):
    write = MooncakeTransport.write  # the producer runs in this process

    def sabotaged(self, peer, src, dst, lengths, **kwargs):
        if how == "drop":
            return None
        return write(self, peer, src, [int(d) + 4096 for d in dst], lengths, **kwargs)

    monkeypatch.setattr(MooncakeTransport, "write", sabotaged)
    assert demo.main(SMALL) == 1
    assert '"tokens_match": false' in capsys.readouterr().out


def test_demo_runs_inside_an_emulated_link_by_default_and_says_so():
    """As root (CI, this machine) `--link auto` runs in a 1 Gbit/s link: the transfer of
    all layers alone then takes at least the bytes' time on the wire."""
    args = [a for a in SMALL if a not in ("--link", "none")] + ["--prompt-len", "1024"]
    proc = subprocess.run([sys.executable, "-m", "torch_kvops.demo", *args], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_match"] is True
    assert result["link"].startswith("emulated link 1gbit"), result["link"]
    assert "link: emulated link 1gbit" in proc.stdout and "regime: " in proc.stdout
    wire_s = result["kv_mib"] * 2**20 * 8 / 1e9
    assert result["transfer_s"] >= 0.75 * wire_s, (result["transfer_s"], wire_s)


def test_without_the_capability_the_demo_says_it_runs_on_plain_loopback(monkeypatch):
    from torch_kvops import emulated_link

    def refuse():
        raise emulated_link.LinkError("the emulated link needs root")

    monkeypatch.setattr(emulated_link, "check_prerequisites", refuse)
    link, why = demo.choose_link("auto")
    assert link is None and why.startswith("plain loopback") and "needs root" in why
    assert demo.choose_link("2.5gbit") == ("2.5gbit", "emulated link 2.5gbit")

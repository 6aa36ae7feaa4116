"""`make demo`'s comparison (disaggregated tokens against the monolithic run) and its
negative control: the same demo with the producer's writes dropped must report a
mismatch and exit 1. Small model, eager only, one round."""
import pytest

from torch_kvops import demo
from torch_kvops.transports.mooncake import MooncakeTransport

SMALL = ["--layers", "4", "--prompt-len", "256", "--repeats", "1", "--new-tokens", "4", "--no-compile"]


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

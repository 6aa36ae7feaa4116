"""The SGLang plugin in a real SGLang 0.5.23 (its own Python, ``.venv-sglang``), without
a fleet: the backend it adds, the check of the SGLang internals it relies on, and what a
decode server tells prefill servers about the windows it reads. (Apart from the fleet
modules, so that they run beside a fleet on the suite's other worker.)"""
from __future__ import annotations

import subprocess

import pytest

from torch_kvops.serving.sglang import sglang_python

pytestmark = [pytest.mark.process, pytest.mark.sglang]


def _in_sglang(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")


def test_the_plugin_adds_the_backend_and_checks_the_sglang_it_runs_in():
    done = _in_sglang(
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.disaggregation import utils\n"
        "from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as c\n"
        "from torch_kvops.integrations.sglang import conn\n"
        "b = utils.TransferBackend('kvops')\n"
        "assert 'kvops' in c and b != utils.TransferBackend.MOONCAKE\n"
        "got = {t.value: utils.get_kv_class(b, t).__name__ for t in utils.KVClassType}\n"
        "print(sorted(got.items()))\n"
        "assert utils.get_kv_class(utils.TransferBackend.MOONCAKE, utils.KVClassType.SENDER)"
        ".__name__ == 'MooncakeKVSender'\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("[('bootstrap_server', 'KvopsKVBootstrapServer'), ('kvargs', 'KVArgs'), "
            "('manager', 'KvopsKVManager'), ('receiver', 'KvopsKVReceiver'), "
            "('sender', 'KvopsKVSender')]") in done.stdout


def test_a_changed_sglang_internal_fails_loudly_at_start_up():
    """A changed signature or a dropped field fails ``check()`` (when the plugin
    installs the backend); an instance attribute SGLang no longer sets fails the
    manager's start (the check runs first thing after SGLang's ``__init__``)."""
    done = _in_sglang(
        "from sglang.srt.disaggregation.common import conn\n"
        "def send(self, pages, state=None): pass\n"
        "conn.CommonKVSender.send = send\n"
        "del conn.PrefillServerInfo.__dataclass_fields__['target_tp_ranks']\n"
        "from torch_kvops.integrations.sglang import internals\n"
        "try:\n"
        "    internals.check()\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
        "manager = conn.CommonKVManager.__new__(conn.CommonKVManager)\n"
        "manager.kv_args = None\n"
        "internals.check_attributes(manager, internals.DECODE_MANAGER_ATTRIBUTES)\n")
    assert done.returncode != 0
    assert "CommonKVSender.send('pages', 'state') differs" in done.stdout, done.stdout[-2000:]
    assert "PrefillServerInfo.target_tp_ranks is gone" in done.stdout, done.stdout[-2000:]
    assert "has no local_ip, rank_port" in done.stderr, done.stderr[-2000:]


def test_a_decode_server_reads_windows_only_without_its_radix_cache_and_with_a_windowed_backend():
    """What a decode rank tells P when it registers (integrations/sglang/windows.py):
    its radix cache, or an attention backend that ignores sliding windows, makes P push
    it every page of every layer."""
    done = _in_sglang(
        "from types import SimpleNamespace as NS\n"
        "from torch_kvops.integrations.sglang.internals import decode_reads_windows_only as f\n"
        "def args(radix=False, backend='torch_native', decode=None):\n"
        "    return NS(disaggregation_decode_enable_radix_cache=radix, attention_backend=backend,\n"
        "              decode_attention_backend=decode)\n"
        "print([f(args()), f(args(backend=None)), f(args(backend='fa3')), f(args(radix=True)),\n"
        "       f(args(backend='flex_attention')), f(args(decode='wave')), f(args(backend='wave', decode='triton'))])\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[True, True, True, False, False, False, True]" in done.stdout, done.stdout[-2000:]

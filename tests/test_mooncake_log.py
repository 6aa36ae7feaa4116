"""Mooncake's start-up log: quiet by default (known-benign lines dropped, real errors
kept), everything with KVOPS_MOONCAKE_LOG=verbose. Each case runs in a fresh process:
Mooncake reads MC_LOG_LEVEL once, and glog prints its first-use notice once."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.process]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MAKE_ENGINE = "from torch_kvops import MooncakeTransport; MooncakeTransport(host='127.0.0.1').close()"


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "KVOPS_MOONCAKE_LOG")}
    clean.update(env)
    clean["PYTHONPATH"] = ROOT + os.pathsep + clean.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=clean, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_default_start_prints_no_benign_error_lines():
    err = run(MAKE_ENGINE)
    assert "Local segment descriptor not found" not in err
    assert "Using default malloc/free" not in err
    assert "InitGoogleLogging" not in err
    assert " transfer_engine_impl.cpp" not in err, "INFO lines must be off by default"


def test_verbose_shows_mooncake_lines():
    err = run(MAKE_ENGINE, KVOPS_MOONCAKE_LOG="verbose")
    assert "Local segment descriptor not found" in err
    assert "transfer_engine_impl.cpp" in err  # Mooncake's INFO level


def test_an_explicit_mc_log_level_is_respected():
    err = run(MAKE_ENGINE, MC_LOG_LEVEL="INFO")
    assert "transfer_engine_impl.cpp" in err
    assert "Local segment descriptor not found" not in err


def test_other_lines_printed_while_the_engine_starts_are_kept():
    """Anything but the known-benign lines, written to fd 2 (as glog does from C++)
    during the filtered window, reaches stderr afterwards, in order."""
    code = (
        "import os\n"
        "from torch_kvops.transports.mooncake.engine_log import benign_lines_dropped\n"
        "with benign_lines_dropped(True):\n"
        "    os.write(2, b'E1123 00:00:00.1 1 transfer_metadata.cpp:1098] Local segment descriptor not found\\n')\n"
        "    os.write(2, b'E1123 00:00:00.2 1 tcp_transport.cpp:1] a real error\\n')\n"
        "    os.write(2, b'partial line without newline')\n"
        "os.write(2, b'|after\\n')\n")
    err = run(code)
    assert err == "E1123 00:00:00.2 1 tcp_transport.cpp:1] a real error\npartial line without newline|after\n"


def test_an_unknown_switch_value_is_a_clear_error():
    with pytest.raises(AssertionError, match="KVOPS_MOONCAKE_LOG='loud': expected one of quiet, verbose"):
        run(MAKE_ENGINE, KVOPS_MOONCAKE_LOG="loud")

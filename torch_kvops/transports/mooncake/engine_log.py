"""Mooncake's start-up log: quiet by default, everything on request.

Mooncake logs through glog to stderr (fd 2, written from C++). By default
(``KVOPS_MOONCAKE_LOG=quiet``) the transport sets ``MC_LOG_LEVEL=WARNING`` unless the
caller set it, and drops the few lines that Mooncake's P2P ``initialize()`` prints on
every start although nothing is wrong (one of them at ERROR level: "Local segment
descriptor not found"). Every other line, real errors included, is shown.
``KVOPS_MOONCAKE_LOG=verbose`` shows everything (docs/mooncake-notes.md).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

__all__ = ["BENIGN_START_LINES", "LOG_SWITCH_ENV", "benign_lines_dropped", "mooncake_log_mode"]

LOG_SWITCH_ENV = "KVOPS_MOONCAKE_LOG"
_LOG_MODES = ("quiet", "verbose")
# Lines Mooncake 0.3.x prints while a P2P-handshake engine starts, none of which means
# anything is wrong: glog's notice that nobody called InitGoogleLogging; the local
# segment looked up before initialize() has added it (logged at ERROR); the default
# allocator for TCP, and the same allocator again for a second engine in one process.
BENIGN_START_LINES = (
    re.compile(rb"Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(rb"transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
    re.compile(rb"transfer_engine_py\.cpp:\d+\] Using default malloc/free for protocol: tcp"),
    re.compile(rb"transfer_engine_py\.cpp:\d+\] Memory allocator already initialized with: tcp"),
)


def mooncake_log_mode() -> str:
    """The KVOPS_MOONCAKE_LOG mode; in quiet mode also default MC_LOG_LEVEL to WARNING
    (Mooncake reads it when an engine is made, so this runs before that)."""
    mode = os.environ.get(LOG_SWITCH_ENV, "quiet").strip().lower() or "quiet"
    if mode not in _LOG_MODES:
        raise ValueError(f"{LOG_SWITCH_ENV}={os.environ[LOG_SWITCH_ENV]!r}: expected one of "
                         f"{', '.join(_LOG_MODES)}")
    if mode == "quiet":
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    return mode


@contextlib.contextmanager
def benign_lines_dropped(enabled: bool) -> Iterator[None]:
    """While the body runs, stderr (fd 2, where glog writes from C++) goes to a
    temporary file; afterwards every line except the known-benign start lines is
    written to the real stderr. Only the engine's start runs under this (milliseconds):
    output of other threads in that window is delayed, never lost, and nothing is
    filtered afterwards, so errors of later transfers show as Mooncake prints them."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = b"".join(line for line in captured.read().splitlines(keepends=True)
                                if not any(p.search(line) for p in BENIGN_START_LINES))
                while kept:
                    kept = kept[os.write(2, kept):]
    finally:
        os.close(saved)

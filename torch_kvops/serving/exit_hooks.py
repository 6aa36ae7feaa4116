"""Stop every server the harness started when its process ends: :func:`atexit`, SIGTERM
and SIGHUP (the reapers cover SIGKILL: :mod:`torch_kvops.serving.reaper`)."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref

# Every server not yet collected (anything with ``name`` and ``stop(grace=...)``).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()
_INSTALLED = False


def track(server) -> None:
    """Stop ``server`` on the harness's exit, and install the hooks on first use."""
    _LIVE.add(server)
    _install()


def stop_every_server() -> None:
    """Stop every server this process started (the atexit and signal hook)."""
    for server in list(_LIVE):
        try:
            server.stop(grace=5.0)
        except (RuntimeError, OSError) as exc:  # ServerError is a RuntimeError
            print(f"[servers] {server.name}: {exc}", file=sys.stderr)


def _install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    atexit.register(stop_every_server)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit and the reapers remain
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            stop_every_server()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)

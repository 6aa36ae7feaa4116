"""Watchdog that runs one server and guarantees none of its processes outlives it.

    python torch_kvops/serving/reaper.py --grace 10 -- python -m vllm.entrypoints... ARGS

(stdlib only: the harness runs it by path, without importing torch_kvops and torch.)

The harness starts the reaper in a new session (it leads its own process group) and the
server inherits that group; vLLM's API server, engine-core process and workers all stay
in it. The reaper is also a child subreaper, so a descendant whose parent dies is
re-parented to it rather than to init. It ends everything (the group and every
descendant: SIGTERM, then SIGKILL after the grace) when:

- its parent dies (even by SIGKILL: the reaper polls ``getppid()``; not
  ``PR_SET_PDEATHSIG``, which fires when the parent *thread* that spawned it exits);
- it gets SIGTERM, SIGINT or SIGHUP (the harness's stop);
- the server exits by itself (its exit status becomes the reaper's).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import List, Set

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.2


def _stat_fields(pid: int) -> List[str]:
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    # the command name is in parentheses and may hold spaces
    return data[data.rindex(")") + 2:].split()


def descendants_and_group(root: int, pgid: int) -> Set[int]:
    """Processes in group ``pgid`` or below ``root`` (by parent links), except ``root``."""
    parent, group = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = _stat_fields(int(name))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # the process exited while we listed /proc
        if fields[0] == "Z":
            continue  # a zombie holds nothing; its parent reaps it
        pid = int(name)
        parent[pid] = int(fields[1])
        if int(fields[2]) == pgid:
            group.add(pid)
    found = set(group)
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found.add(child)
                frontier.append(child)
    found.discard(root)
    return found


def signal_all(pids: Set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # exited meanwhile: nothing left to end


def reap_zombies() -> None:
    """Collect re-parented descendants that exited (we are their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_everything(server: subprocess.Popen, grace: float) -> None:
    """SIGTERM the server and all other processes of ours, SIGKILL what is left after
    ``grace`` seconds, and wait until none remains."""
    me, pgid = os.getpid(), os.getpgid(0)
    signal_all(descendants_and_group(me, pgid), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap_zombies()
        if not descendants_and_group(me, pgid):
            return
        time.sleep(0.05)
    left = descendants_and_group(me, pgid)
    print(f"[reaper] SIGKILL to {sorted(left)} after a {grace} s grace", file=sys.stderr, flush=True)
    for _ in range(50):
        signal_all(left, signal.SIGKILL)
        reap_zombies()
        left = descendants_and_group(me, pgid)
        if not left:
            return
        time.sleep(0.05)
    print(f"[reaper] still alive after SIGKILL: {sorted(left)}", file=sys.stderr, flush=True)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run")
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"[reaper] PR_SET_CHILD_SUBREAPER failed (errno {ctypes.get_errno()}): "
              "descendants that leave the group may outlive the server", file=sys.stderr, flush=True)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = subprocess.Popen(command)  # same process group as the reaper
    status = None
    while stop["signal"] is None:
        status = server.poll()
        if status is not None:
            break
        if os.getppid() != parent:
            print("[reaper] parent died: ending the server", file=sys.stderr, flush=True)
            break
        time.sleep(POLL_S)
    end_everything(server, args.grace)
    status = server.poll() if status is None else status
    if stop["signal"] is not None:
        return 0  # stopped on request
    return status if status is not None and status >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())

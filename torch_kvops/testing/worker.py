"""A child process driven over a pipe: the shape shared by the test consumer and the
demo's decode process. Every call has a timeout; a failure in the child comes back
with its traceback."""
from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any, Callable, Dict


def serve(pipe, handlers: Dict[str, Callable[..., Any]], on_close: Callable[[], None]) -> None:
    """Child side: answer ``(command, *args)`` messages until ``close``."""
    try:
        while True:
            cmd, *args = pipe.recv()
            if cmd == "close":
                on_close()
                pipe.send(("ok", None))
                return
            pipe.send(("ok", handlers[cmd](*args)))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise


class WorkerProcess:
    """Parent side. ``target(pipe, *args)`` must first send ``("ok", hello)`` (kept as
    ``self.hello``), then :func:`serve`."""

    def __init__(self, target: Callable, args: tuple, name: str, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.name, self.timeout = name, timeout
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.hello = self.reply()

    def send(self, *cmd) -> None:
        self._pipe.send(cmd)

    def reply(self, timeout: float = None):
        if not self._pipe.poll(timeout or self.timeout):
            raise TimeoutError(f"{self.name} process did not answer")
        status, value = self._pipe.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} process failed:\n{value}")
        return value

    def call(self, *cmd, timeout: float = None):
        self.send(*cmd)
        return self.reply(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close", timeout=30)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()

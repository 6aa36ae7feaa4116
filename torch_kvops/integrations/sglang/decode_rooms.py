"""The decode side's rooms: a room is Success once its KV landed (the connector's
outcome) and its metadata row (first token, room; sent by the prefill side over
SGLang's ZMQ socket) was written; an aborted room ends only with the connector's
outcome, so its pages go back to SGLang when no write of the prefill can land."""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

from .pages import write_rows


class DecodeRooms:
    """State of the rooms a decode rank waits for (thread-safe). A room's KV comes as
    one or more parts (one per prefill rank sending heads here: :mod:`.heads`); it has
    landed when every part has, and it fails only once every part ended, so no write of
    any prefill rank can land in its pages afterwards."""

    def __init__(self, kv_args, succeed: Callable[[int], None],
                 fail: Callable[[int, str], None]) -> None:
        self.kv_args, self._succeed, self._fail = kv_args, succeed, fail
        self._lock = threading.Lock()
        self._rows: Dict[int, int] = {}  # room -> its metadata row
        self._parts: Dict[int, Tuple[str, ...]] = {}  # room -> the connector ids of its parts
        self._open: Dict[int, Set[str]] = {}  # room -> its parts not ended yet
        self._failures: Dict[int, str] = {}  # room -> why a part failed
        self._rows_in: Set[int] = set()
        self._aborted: Set[int] = set()
        self._settled: Set[int] = set()  # reported to SGLang (once)

    def __len__(self) -> int:
        return len(self._rows)

    def expect(self, room: int, row: int, parts: List[str]) -> None:
        with self._lock:
            self._rows[room] = row
            self._parts[room] = tuple(parts)
            self._open[room] = set(parts)

    def parts(self, room: int) -> Tuple[str, ...]:
        with self._lock:
            return self._parts.get(room, ())

    def part_ended(self, room: int, part: str, failure: Optional[str] = None) -> bool:
        """A part landed, or failed with ``failure``; False for a part of no room
        waited for here."""
        with self._lock:
            waiting = self._open.get(room)
            if waiting is None or part not in self._parts[room]:
                return False
            waiting.discard(part)
            if failure is not None:
                self._failures.setdefault(room, failure)
        self._settle(room)
        return True

    def row_arrived(self, room: int, rows: List[bytes]) -> None:
        """Write the room's metadata row, if the room is still waited for; sizes and
        bounds are checked before a byte is written."""
        with self._lock:
            row = self._rows.get(room)
            if row is None or room in self._aborted:
                return  # not (or no longer) waited for: nothing is written
            write_rows(self.kv_args.aux_data_ptrs, self.kv_args.aux_data_lens,
                       self.kv_args.aux_item_lens, row, rows)
            self._rows_in.add(room)
        self._settle(room)

    def give_up(self, room: int) -> None:
        with self._lock:
            self._aborted.add(room)
        self._settle(room)

    def forget(self, room: int) -> None:
        with self._lock:
            for table in (self._rows_in, self._aborted, self._settled):
                table.discard(room)
            for by_room in (self._rows, self._parts, self._open, self._failures):
                by_room.pop(room, None)

    def _settle(self, room: int) -> None:
        """Report the room once every part ended: failed if a part failed or the room
        was aborted, success once its metadata row is in too."""
        with self._lock:
            if room in self._settled or self._open.get(room, True):
                return  # reported, not waited for, or parts still out
            failure = self._failures.get(room)
            if failure is None and room in self._aborted:
                failure = "aborted by the engine"
            if failure is None and room not in self._rows_in:
                return
            self._settled.add(room)
        if failure is not None:
            self._fail(room, failure)
        else:
            self._succeed(room)

"""The decode side's rooms: a room is Success once its KV landed (the connector's
outcome) and its metadata row (first token, room; sent by the prefill side over
SGLang's ZMQ socket) was written; an aborted room ends only with the connector's
outcome, so its pages go back to SGLang when no write of the prefill can land."""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Set

from .pages import write_rows


class DecodeRooms:
    """State of the rooms a decode rank waits for (thread-safe)."""

    def __init__(self, kv_args, succeed: Callable[[int], None],
                 fail: Callable[[int, str], None]) -> None:
        self.kv_args, self._succeed, self._fail = kv_args, succeed, fail
        self._lock = threading.Lock()
        self._rows: Dict[int, int] = {}  # room -> its metadata row
        self._landed: Set[int] = set()
        self._rows_in: Set[int] = set()
        self._aborted: Set[int] = set()
        self._settled: Set[int] = set()  # reported to SGLang (once)

    def __len__(self) -> int:
        return len(self._rows)

    def expect(self, room: int, row: int) -> None:
        with self._lock:
            self._rows[room] = row

    def landed(self, room: int) -> None:
        with self._lock:
            self._landed.add(room)
        self._settle(room)

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
            for table in (self._landed, self._rows_in, self._aborted, self._settled):
                table.discard(room)
            self._rows.pop(room, None)

    def _settle(self, room: int) -> None:
        """Report the room once: failed if aborted and its KV is in (no write can land
        any more), success if its KV and its row are in."""
        with self._lock:
            if room in self._settled or room not in self._landed:
                return
            aborted = room in self._aborted
            if not aborted and room not in self._rows_in:
                return
            self._settled.add(room)
        if aborted:
            self._fail(room, "aborted by the engine")
        else:
            self._succeed(room)

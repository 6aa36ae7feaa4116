"""A room's transfers: one per decode rank that room goes to (with MLA and fewer
prefill ranks than decode ranks, one prefill rank pushes the whole latent to each),
each under a connector id of its own that both sides derive."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def transfer_id(room: int, decode_session: str) -> str:
    """The connector's id of ``room``'s transfer to the decode rank whose connector
    engine id is ``decode_session``."""
    return f"{room}@{decode_session}"


def room_of(transfer: str) -> int:
    return int(transfer.partition("@")[0])


@dataclass(frozen=True)
class Destination:
    """One decode rank's destination of one room."""

    peer: str  # the connector's peer id of that decode rank
    endpoint: str  # its ZMQ socket
    pages: np.ndarray  # its page ids for the room, in token order
    aux_index: int
    session: str  # that rank's connector engine id

    def transfer(self, room: int) -> str:
        return transfer_id(room, self.session)

"""``kv_transfer_params`` as clients and routers send them, validated where they enter.

Every field comes from a client (or a router in front of it), so each one is checked
before the connector acts on it; a bad one raises :class:`BadTransferParams` and the
caller serves that request alone without a transfer (P prefills it without a push, D
computes the prompt itself). Two dialects are accepted:

- ours: P ``{do_remote_decode, transfer_id[, kvops_push_mode]}``; D
  ``{do_remote_prefill, transfer_id, kvops_producer: "host:port"}`` (P's side channel);
- vLLM's MooncakeConnector / vllm-router (mooncake mode): P ``{do_remote_decode: true,
  do_remote_prefill: false, transfer_id}``; D ``{do_remote_prefill: true, transfer_id,
  remote_bootstrap_addr: "http://host:port", remote_engine_id}``.

D forwards the producer address it got (either form) to its poster unchanged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from .metadata import PUSH_MODES

MAX_FIELD_CHARS = 256
# "xfer-<uuid>" (vllm-router), "cmpl-..." ids, our own test ids: no spaces, no "|"
# (tp.part_id appends "|p<r>d<r>" to name a rank's part)
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,%d}" % MAX_FIELD_CHARS)
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


class BadTransferParams(ValueError):
    """A malformed ``kv_transfer_params`` field; the message names it."""


@dataclass(frozen=True)
class PrefillParams:
    """P: this request's KV goes to a decode engine under ``transfer_id``."""

    transfer_id: str
    push_mode: Optional[str]  # None: the engine's push_mode setting


@dataclass(frozen=True)
class DecodeParams:
    """D: this request's prompt KV comes from the prefill engine at ``producer``
    (``host:port`` of its side channel, or ``http://host:port`` of its bootstrap
    endpoint), under ``transfer_id``."""

    transfer_id: str
    producer: str
    remote_engine_id: Optional[str]

    @property
    def post_to(self) -> str:
        """Where D posts: the side channel, or the bootstrap endpoint with the engine id
        of the DP rank that holds the request (``http://host:port#engine_id``; the
        poster reads that rank's side channel from ``GET /query``)."""
        if self.remote_engine_id and self.producer.startswith("http"):
            return f"{self.producer.rstrip('/')}#{self.remote_engine_id}"
        return self.producer


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadTransferParams(f"{key} must be true or false, got {type(value).__name__}")
    return value


def _text(params: Mapping[str, Any], key: str) -> str:
    value = params[key]
    if not isinstance(value, str):
        raise BadTransferParams(f"{key} must be a string, got {type(value).__name__}")
    if len(value) > MAX_FIELD_CHARS:
        raise BadTransferParams(f"{key} is longer than {MAX_FIELD_CHARS} characters")
    return value


def transfer_id(params: Mapping[str, Any]) -> str:
    """The request's ``transfer_id`` (required, a string of at most 256 id characters)."""
    if "transfer_id" not in params:
        raise BadTransferParams("transfer_id is missing")
    tid = _text(params, "transfer_id")
    if not _TRANSFER_ID.fullmatch(tid):
        raise BadTransferParams(f"transfer_id {tid!r} must be 1-{MAX_FIELD_CHARS} characters of "
                                "letters, digits and ._:@+=/-")
    return tid


def host_port(address: str, key: str) -> str:
    """``host:port`` checked (host a name or address, port 1-65535); returned as given."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise BadTransferParams(f"{key} {address!r} must be host:port")
    if not _HOST.fullmatch(host):
        raise BadTransferParams(f"{key} {address!r}: bad host")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise BadTransferParams(f"{key} {address!r}: port must be an integer in 1-65535")
    return address


def _params_dict(params: Any) -> Mapping[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise BadTransferParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
    return params


def prefill_params(params: Any) -> Optional[PrefillParams]:
    """P: None for a request that is not prefilled for a decode engine."""
    params = _params_dict(params)
    if not _flag(params, "do_remote_decode"):
        return None
    if _flag(params, "do_remote_prefill"):
        raise BadTransferParams("do_remote_decode and do_remote_prefill are both true")
    tid = transfer_id(params)
    mode = params.get("kvops_push_mode")
    if mode is not None and mode not in PUSH_MODES:
        raise BadTransferParams(f"kvops_push_mode must be one of {PUSH_MODES}, got {mode!r}")
    return PrefillParams(tid, mode)


def decode_params(params: Any) -> Optional[DecodeParams]:
    """D: None for a request whose prompt is not prefilled remotely."""
    params = _params_dict(params)
    if not _flag(params, "do_remote_prefill"):
        return None
    tid = transfer_id(params)
    if params.get("kvops_producer") is not None:  # ours: P's side channel itself
        producer = host_port(_text(params, "kvops_producer"), "kvops_producer")
    elif params.get("remote_bootstrap_addr") is not None:  # vLLM's: P's bootstrap endpoint
        producer = _text(params, "remote_bootstrap_addr")
        scheme, sep, rest = producer.partition("://")
        if not sep or scheme not in ("http", "https"):
            raise BadTransferParams(f"remote_bootstrap_addr {producer!r} must be http://host:port")
        host_port(rest.rstrip("/"), "remote_bootstrap_addr")
    else:
        raise BadTransferParams("do_remote_prefill needs kvops_producer (host:port) or "
                                "remote_bootstrap_addr (http://host:port)")
    engine = params.get("remote_engine_id")
    if engine is not None:
        engine = _text(params, "remote_engine_id")
    return DecodeParams(tid, producer, engine)


def for_decode(transfer_id: str, producer: str) -> Dict[str, Any]:
    """P's answer in its output's ``kv_transfer_params``: what D needs, for routers that
    forward P's params to D (vllm-router's nixl mode)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "kvops_producer": producer}

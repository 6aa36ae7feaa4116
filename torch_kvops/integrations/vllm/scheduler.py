"""Scheduler side: pairs a request across the prefill (P) and decode (D) engines.

Protocol (docs/vllm.md): a router sends the request to P with ``{"do_remote_decode":
true, "transfer_id": T}`` and to D with ``{"do_remote_prefill": true, "transfer_id": T,
"kvops_producer": "host:port"}`` (or vLLM's ``remote_bootstrap_addr``), in any order
or at once. D reports the whole prompt as an asynchronous external hit, allocates its
blocks, and posts ``{T, block ids, per-rank peer_info}`` to P's side channel, which
answers with P's tensor-parallel size (each D rank then knows which parts of T it
receives: tp.py). P binds the destination whenever it arrives and pushes each block
once both its KV is written and the destination is known (scheduler_producer.py).
The transfer stays open on D meanwhile; its lease bounds the wait.
"""
from .scheduler_consumer import ConsumerScheduler
from .scheduler_producer import ProducerScheduler

__all__ = ["ConsumerScheduler", "ProducerScheduler"]

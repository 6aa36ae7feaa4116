"""The two processes of ``python -m torch_kvops.demo`` (torch_kvops/demo.py runs the
experiment and reports it).

:func:`decode_main` is the decode instance, in a spawned process driven over a pipe:
it allocates blocks for each request, reports when the KV has landed, and decodes
greedily from it. :class:`PrefillSide` is the prefill instance in the calling process:
model, caches and producer connector, and the timed scenarios (the forward alone, the
transfer alone, disaggregated with layer-wise push or with the push after the forward).
:func:`reference_tokens` is the monolithic run the disaggregated tokens must equal.
"""
from __future__ import annotations

import time
import traceback
from typing import Dict, List

import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..plan import TransferRequest
from ..transports import MooncakeTransport
from .paged_llama import (BlockAllocator, LlamaConfig, PagedLlama, blocks_needed, decode_from_cache,
                          prefill)
from .worker import serve

__all__ = ["PrefillSide", "decode_main", "reference_tokens"]


# ---------------------------------------------------------------------- decode process

def decode_main(pipe, cfg_kwargs: dict, num_blocks: int, threads: int, device: str) -> None:
    """The decode instance (a WorkerProcess target): model, caches and consumer connector,
    serving alloc / wait / decode / free over ``pipe``."""
    try:
        torch.set_num_threads(threads)
        model = PagedLlama(LlamaConfig(**cfg_kwargs)).eval().to(device)
        caches = model.allocate_kv_caches(num_blocks, device)
        allocator = BlockAllocator(num_blocks)
        transport = MooncakeTransport(host="127.0.0.1")
        conn = LayerwiseConnector("consumer", transport, ConnectorConfig())
        conn.register_kv_caches(caches)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    tables: Dict[str, List[int]] = {}
    pipe.send(("ok", conn.peer_info()))

    def alloc(requests):  # [(req_id, prompt_len)] -> {req_id: block table}
        for req_id, n in requests:
            tables[req_id] = allocator.allocate(blocks_needed(n, model.cfg.block_size))
            conn.expect(req_id)
        return {r: list(tables[r]) for r, _ in requests}

    def wait(req_ids):  # -> ({req_id: wall-clock time it landed}, failed ids)
        pending, landed, failed = set(req_ids), {}, set()
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            done, bad = conn.get_finished()
            now = time.time()
            for r in done & pending:
                landed[r] = now
            failed |= bad & pending
            pending -= done | bad
            time.sleep(0.0005)
        return landed, sorted(failed | pending)

    def decode(requests, max_new):  # [(req_id, prompt_len, first_token)] -> tokens
        return decode_from_cache(model, [[0] * n for _, n, _ in requests], [t for _, _, t in requests],
                                 [tables[r] for r, _, _ in requests], caches, max_new, allocator)

    def free(req_ids):
        for r in req_ids:
            allocator.free(tables.pop(r))

    def close():
        conn.close()
        transport.close()

    serve(pipe, {"alloc": alloc, "wait": wait, "decode": decode, "free": free}, close)


# ---------------------------------------------------------------------- prefill side


class PrefillSide:
    """The producer: model, caches, connector, and the timed scenarios."""

    def __init__(self, args, decode, cfg, prompts) -> None:
        self.args, self.decode, self.prompts = args, decode, prompts
        self.model = PagedLlama(cfg).eval().to(args.device)
        self.caches = self.model.allocate_kv_caches(args.num_blocks, args.device)
        self.allocator = BlockAllocator(args.num_blocks)
        self.transport = MooncakeTransport(host="127.0.0.1")
        self.conn = LayerwiseConnector("producer", self.transport, ConnectorConfig())
        self.conn.register_kv_caches(self.caches)
        self.peer = self.conn.add_peer(decode.hello)
        self.forwards = {"eager": self.model}
        if args.compile:
            self.forwards["compiled"] = torch.compile(self.model, fullgraph=True)
        self.counter = 0

    def close(self) -> None:
        self.conn.close()
        self.transport.close()

    def _tables(self):
        self.counter += 1
        ids = [f"r{self.counter}-{i}" for i in range(len(self.prompts))]
        dst = self.decode.call("alloc", [(r, len(p)) for r, p in zip(ids, self.prompts)])
        src = [self.allocator.allocate(blocks_needed(len(p), self.model.cfg.block_size))
               for p in self.prompts]
        requests = [TransferRequest(r, self.peer, s, dst[r]) for r, s in zip(ids, src)]
        return ids, src, requests

    def _release(self, ids, src) -> None:
        """Free a round's blocks on both sides, the source blocks only once the producer
        reports the requests finished (the rule the connector docs give engines)."""
        deadline = time.monotonic() + 30
        pending = set(ids)
        while pending:
            done, failed = self.conn.get_finished()
            if failed & pending:
                raise RuntimeError(f"requests failed: {sorted(failed & pending)}")
            pending -= done
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"producer never reported {sorted(pending)} finished")
            time.sleep(0.001)
        for table in src:
            self.allocator.free(table)
        self.decode.call("free", ids)

    def compute_only(self, flavor: str) -> float:
        self.model.kv_hook = None
        tables = [[] for _ in self.prompts]
        t0 = time.perf_counter()
        prefill(self.model, self.prompts, self.caches, tables, allocator=self.allocator,
                forward=self.forwards[flavor])
        elapsed = time.perf_counter() - t0
        for table in tables:
            self.allocator.free(table)
        return elapsed

    def _push_all_layers(self) -> None:
        for layer, cache in enumerate(self.caches):
            self.conn.save_kv_layer(layer, cache)

    def _kv_ready(self, t0: float) -> float:
        """Seconds from ``t0`` until the decode side had every request of the step."""
        self.conn.wait_for_save(timeout=120)
        landed, failed = self.decode.reply(300)
        if failed:
            raise RuntimeError(f"requests failed: {failed}")
        return max(landed.values()) - t0

    def transfer_only(self) -> float:
        ids, src, requests = self._tables()
        self.conn.start_step(requests)
        self.decode.send("wait", ids)
        t0 = time.time()
        self._push_all_layers()
        ready = self._kv_ready(t0)
        self._release(ids, src)
        return ready

    def disaggregated(self, flavor: str, layerwise: bool, verify: List[List[int]] = None):
        """Returns (kv_ready_s, forward_s, tokens or None, trace)."""
        ids, src, requests = self._tables()
        self.model.kv_hook = self.conn.save_kv_layer if layerwise else None
        self.conn.start_step(requests)
        self.decode.send("wait", ids)
        t0 = time.time()
        p0 = time.perf_counter()
        first = prefill(self.model, self.prompts, self.caches, [list(s) for s in src],
                        forward=self.forwards[flavor])
        forward_s = time.time() - t0
        if not layerwise:
            self._push_all_layers()
        kv_ready = self._kv_ready(t0)
        trace = [{k: (v - p0 if isinstance(v, float) else v) for k, v in row.items()}
                 for row in self.conn.last_step_trace()]
        tokens = None
        if verify is not None:
            requests = [(r, len(p), t) for r, p, t in zip(ids, self.prompts, first)]
            tokens = self.decode.call("decode", requests, self.args.new_tokens)
        self.model.kv_hook = None
        self._release(ids, src)
        return kv_ready, forward_s, tokens, trace


def reference_tokens(side: PrefillSide, flavor: str) -> List[List[int]]:
    """Monolithic run in this process: prefill with ``flavor``, eager decode."""

    side.model.kv_hook = None
    tables = [[] for _ in side.prompts]
    try:
        first = prefill(side.model, side.prompts, side.caches, tables, allocator=side.allocator,
                        forward=side.forwards[flavor])
        return decode_from_cache(side.model, side.prompts, first, tables, side.caches,
                                 side.args.new_tokens, side.allocator)
    finally:
        for table in tables:
            side.allocator.free(table)


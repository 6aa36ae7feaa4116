"""Soak: hundreds of steps of random requests, some chunked over 2-3 steps, to two
consumers, one SIGKILLed a third of the way in. Every id is reported exactly once on
both sides, the live consumer's bytes are exact, and threads, fds and RSS stay flat.
The live consumer's engine stand-in gives a request's destination blocks to later
requests as soon as the consumer reports it (its pool is small, so they are reused
many times over): a late byte of an earlier request would show in the final check.

Bounded: SOAK_STEPS steps plus a few to finish the chunked requests, ~1 minute on the
2-core CI machine. The engine stand-in frees a request's source blocks when the
producer reports it, so a second report would free them twice (and is caught).
"""
import collections
import os
import random
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import ConsumerProcess, process_resources

pytestmark = [pytest.mark.process]

SOAK_STEPS, KILL_AT, WARM_UP = 300, 100, 140
LAYERS, SRC_BLOCKS, DST_BLOCKS, BLOCK_SHAPE = 2, 512, 6144, (2, 8, 16)  # 1 KiB blocks
ALIVE_POOL = 512  # the live consumer's destination blocks, reused once reported
CONFIG = dict(transfer_timeout_s=5.0, max_retries=1, retry_backoff_s=0.02, lease_s=30.0,
              control_timeout_s=5.0, quarantine_s=0.2, staging_slot_bytes=64 << 10,
              staging_slots=3,
              accept_unsolicited_pushes=True)  # the soak pushes without expect() (test_admission.py)
# A leak of one fd, one thread or ~50 KiB per step over the 160 measured steps would
# exceed these; allocator noise does not.
FD_SLACK, THREAD_SLACK, RSS_SLACK_KIB = 4, 2, 8 << 10


class Request:
    def __init__(self, req_id, consumer, chunks):
        self.req_id, self.consumer, self.chunks_left = req_id, consumer, chunks
        self.src, self.dst = [], []  # every block of every chunk, kept until reported


def test_soak_two_consumers_one_killed():
    started = time.monotonic()
    rng = random.Random(10)
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.zeros(SRC_BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    consumers = {name: ConsumerProcess(LAYERS, DST_BLOCKS, BLOCK_SHAPE, **CONFIG)
                 for name in ("alive", "doomed")}
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    try:
        conn.register_kv_caches(caches)
        peers = {name: conn.add_peer(proc.info) for name, proc in consumers.items()}
        free_src = list(range(SRC_BLOCKS))
        next_dst = 0  # the doomed consumer's destination blocks: never reused
        free_dst = list(range(ALIVE_POOL))  # the live one's: reused once reported, newest first
        rng.shuffle(free_dst)
        reused = 0
        expected = {}  # alive consumer: dst block -> the value its layer-0 elements hold
        pending, all_reqs = [], {}
        producer_reports = collections.Counter()
        consumer_reports = collections.Counter()
        outcome = {}
        samples = {}
        stamp = 0

        def drain_producer():
            finished, failed = conn.get_finished()
            for req_id in finished | failed:
                producer_reports[req_id] += 1
                outcome[req_id] = req_id in finished
                req = all_reqs[req_id]
                free_src.extend(req.src)  # a second report would free them twice
                if req in pending:  # failed: the engine aborts it (no more chunks)
                    pending.remove(req)

        step = 0
        while step < SOAK_STEPS or pending:
            if step == KILL_AT:
                consumers["doomed"].kill()
            if step < SOAK_STEPS:
                for _ in range(rng.randint(1, 4)):
                    req = Request(f"r{len(all_reqs)}", rng.choice(sorted(consumers)),
                                  rng.choice([1, 1, 2, 3]))
                    all_reqs[req.req_id] = req
                    pending.append(req)
            batch = []
            for req in list(pending):
                n = rng.randint(1, 8)
                if len(free_src) < n or (req.consumer == "alive" and len(free_dst) < n):
                    continue  # the engine would wait for blocks: this chunk goes next step
                src = [free_src.pop() for _ in range(n)]
                if req.consumer == "alive":
                    dst = [free_dst.pop() for _ in range(n)]  # the last freed first
                    reused += sum(d in expected for d in dst)
                else:
                    dst = list(range(next_dst, next_dst + n))
                    next_dst += n
                req.src += src
                req.dst += dst
                req.chunks_left -= 1
                batch.append(TransferRequest(req.req_id, peers[req.consumer], src, dst,
                                             last_chunk=req.chunks_left == 0))
                if req.chunks_left == 0:
                    pending.remove(req)
                for s, d in zip(src, dst):
                    stamp += 1
                    for layer, cache in enumerate(caches):
                        cache[s].fill_(stamp * 4 + layer)
                    if req.consumer == "alive":
                        expected[d] = stamp * 4
            conn.start_step(batch)
            for layer, cache in enumerate(caches):
                conn.save_kv_layer(layer, cache)
            conn.wait_for_save(timeout=60)
            drain_producer()
            if step % 10 == 0:
                finished, failed = consumers["alive"].call("drain")
                consumer_reports.update(finished + failed)
                for req_id in finished + failed:  # the engine hands the blocks on
                    free_dst.extend(all_reqs[req_id].dst)
            if step in (WARM_UP, SOAK_STEPS - 1):
                samples[step] = {"producer": process_resources(),
                                 "consumer": consumers["alive"].call("resources")}
            step += 1

        deadline = time.monotonic() + 30
        while len(producer_reports) < len(all_reqs) and time.monotonic() < deadline:
            drain_producer()
            time.sleep(0.02)
        alive_ids = {r for r, req in all_reqs.items() if req.consumer == "alive"}
        while set(consumer_reports) < alive_ids and time.monotonic() < deadline:
            finished, failed = consumers["alive"].call("drain")
            consumer_reports.update(finished + failed)
            time.sleep(0.02)
        time.sleep(0.5)  # a duplicate would come after the first report
        drain_producer()
        finished, failed = consumers["alive"].call("drain")
        consumer_reports.update(finished + failed)

        # Exactly once, on both sides.
        assert set(producer_reports) == set(all_reqs)
        assert [r for r, n in producer_reports.items() if n != 1] == []
        assert set(consumer_reports) == alive_ids
        assert [r for r, n in consumer_reports.items() if n != 1] == []
        assert sorted(free_src) == list(range(SRC_BLOCKS)), "every source block freed once"
        # Outcomes: the live consumer got everything; the killed one failed after the kill.
        assert all(outcome[r] for r in alive_ids), [r for r in alive_ids if not outcome[r]]
        assert 600 <= len(all_reqs) <= 900
        assert any(not ok for ok in outcome.values()), "the kill must fail requests"
        assert sum(1 for req in all_reqs.values() if req.consumer == "doomed" and outcome[req.req_id]) > 0
        stats = conn.stats()
        assert stats["requests_finished"] + stats["requests_failed"] == len(all_reqs)
        assert stats["staged_writes"] > 0, "fragmented 1 KiB blocks go through staging"
        # The live consumer's bytes.
        received = consumers["alive"].call("caches")
        blocks = np.array(sorted(expected))
        values = np.array([expected[b] for b in blocks], dtype=np.float32)
        for layer in range(LAYERS):
            got = received[layer][blocks].reshape(len(blocks), -1)
            assert (got == (values + layer)[:, None]).all(), f"layer {layer}: bytes differ"
        unused = sorted(set(range(DST_BLOCKS)) - set(expected))
        assert (received[0][unused] == -7.0).all(), "nothing beyond the mapping"
        assert reused > 1000, f"destination blocks must be reused: {reused}"
        # Flat resources after warm-up.
        for side in ("producer", "consumer"):
            first, last = samples[WARM_UP][side], samples[SOAK_STEPS - 1][side]
            assert last["fds"] - first["fds"] <= FD_SLACK, (side, first, last)
            assert last["threads"] - first["threads"] <= THREAD_SLACK, (side, first, last)
            assert last["rss_kib"] - first["rss_kib"] <= RSS_SLACK_KIB, (side, first, last)
        print(f"soak: {step} steps, {len(all_reqs)} requests, {reused} destination blocks reused, "
              f"{sum(not ok for ok in outcome.values())} failed, {time.monotonic() - started:.1f} s, "
              f"resources {samples}")
    finally:
        conn.close()
        transport.close()
        consumers["alive"].stop()
        consumers["doomed"].kill()

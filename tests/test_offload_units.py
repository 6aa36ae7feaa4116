"""KvopsOffloadingSpec pieces without an engine: descriptor building (byte-exact on CPU
tensors, through the real op), the worker's job handling and failure policy, start-up
checks of the spec and of the engine's KV tensors."""
import dataclasses

import numpy as np
import pytest
import torch

import torch_kvops  # noqa: F401  (registers the ops)
from torch_kvops.integrations.vllm.offload import KvopsOffloadingSpec, KvopsOffloadingWorker
from torch_kvops.offload import (DescriptorBuilder, GroupRef, OffloadConfigError, OffloadJobError,
                                 build_host_tier, copiers)
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                     GPULoadStoreSpec, TransferResult)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

SENTINEL = 0x5A


def engine_tensor(num_blocks, page, stride_pages=1, seed=0):
    """(num_blocks, page) int8 view with random bytes; blocks `stride_pages` pages apart
    (a packed layout's stride when > 1)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-128, 128, (num_blocks * stride_pages * page,), generator=g, dtype=torch.int8)
    return base.as_strided((num_blocks, page), (stride_pages * page, 1)), base


class Setup:
    """Two cache groups over three KV tensors: group 0 = tensors 0 and 1 (padded pages:
    3000 of 4096 bytes are data), group 1 = tensor 2 (packed: blocks 2 pages apart)."""

    def __init__(self, bpc, num_chunks=12, num_blocks=20):
        self.bpc = bpc
        self.pages = [4096, 4096, 2048]
        views = [engine_tensor(num_blocks, 4096, seed=1), engine_tensor(num_blocks, 4096, seed=2),
                 engine_tensor(num_blocks, 2048, stride_pages=2, seed=3)]
        self.engine = [v for v, _ in views]
        self.buffers = [b for _, b in views]  # all bytes, the packed tensor's gaps included
        self.refs = [[GroupRef(0, 3000), GroupRef(1, 3000)], [GroupRef(2, 2048)]]
        self.tier = build_host_tier(self.engine, self.pages, self.refs, num_chunks, bpc)
        for h in self.tier.host:
            h.fill_(SENTINEL)
        self.worker = KvopsOffloadingWorker(self.tier)

    def expected_pairs(self, group_blocks, group_starts, group_chunks):
        """Naive reference: (tensor, engine block, chunk, slot, bytes) for every page
        a job copies; engine block k of a group goes to slot (start % bpc + k) of the
        group's chunks, counted from the first chunk."""
        out = []
        for g, (blocks, start, chunks) in enumerate(zip(group_blocks, group_starts, group_chunks)):
            for k, block in enumerate(blocks):
                position = start % self.bpc + k
                for ref in self.refs[g]:
                    out.append((ref.region, block, chunks[position // self.bpc],
                                position % self.bpc, ref.copy_bytes))
        return out


def job(group_blocks, group_starts, group_chunks):
    blocks = [b for bs in group_blocks for b in bs]
    chunks = [c for cs in group_chunks for c in cs]
    return (GPULoadStoreSpec(blocks, [len(b) for b in group_blocks], group_starts),
            CPULoadStoreSpec(chunks))


# blocks_per_chunk -> (engine blocks, first logical block, host chunks), per group.
# bpc 4: group 0's 7 blocks start at logical block 6, i.e. in slot 2 of their first
# chunk, and span three chunks; bpc 3: both groups start inside a chunk. Engine ids
# unsorted with gaps, plus adjacent pairs (3, 4) whose copies merge.
CASES = {
    1: ([[3, 4, 11, 0, 17, 9, 8], [5, 6]], [5, 0], [[2, 3, 4, 5, 6, 7, 8], [9, 0]]),
    4: ([[3, 4, 11, 0, 17, 9, 8], [5, 6]], [6, 0], [[7, 2, 10], [4]]),
    3: ([[3, 4, 11, 0, 17, 9, 8], [5, 6]], [4, 2], [[7, 2, 10], [4, 1]]),
}


@pytest.mark.parametrize("bpc", sorted(CASES))
def test_store_writes_exactly_the_named_pages(bpc):
    s = Setup(bpc)
    blocks, starts, chunks = CASES[bpc]
    src, dst = job(blocks, starts, chunks)
    assert s.worker.submit_store(7, src, dst) is True
    expected = [torch.full_like(h, SENTINEL) for h in s.tier.host]
    pairs = s.expected_pairs(blocks, starts, chunks)
    for t, block, chunk, slot, nbytes in pairs:
        page = s.pages[t]
        expected[t][chunk, slot * page:slot * page + nbytes] = s.engine[t][block, :nbytes]
    for t in range(3):
        assert torch.equal(s.tier.host[t], expected[t]), f"tensor {t}"
    (result,) = s.worker.get_finished()
    assert result.job_id == 7 and result.success
    assert result.transfer_size == sum(p[-1] for p in pairs)
    assert result.transfer_time is not None and result.transfer_time >= 0


@pytest.mark.parametrize("bpc", sorted(CASES))
def test_load_writes_exactly_the_named_blocks(bpc):
    s = Setup(bpc)
    blocks, starts, chunks = CASES[bpc]
    g = torch.Generator().manual_seed(9)
    for h in s.tier.host:
        h.copy_(torch.randint(-128, 128, h.shape, generator=g, dtype=torch.int8))
    before = [b.clone() for b in s.buffers]
    gpu, cpu = job(blocks, starts, chunks)
    assert s.worker.submit_load(3, cpu, gpu) is True
    expected = [b.clone() for b in before]
    for t, block, chunk, slot, nbytes in s.expected_pairs(blocks, starts, chunks):
        page, stride = s.pages[t], s.engine[t].stride(0)
        expected[t][block * stride:block * stride + nbytes] = \
            s.tier.host[t][chunk, slot * page:slot * page + nbytes]
    for t in range(3):
        # every byte of the buffer: the padding after a page's data and the packed
        # tensor's bytes between blocks (another layer's) stay as they were
        assert torch.equal(s.buffers[t], expected[t]), f"tensor {t}"
    assert [r.job_id for r in s.worker.get_finished()] == [3]


@pytest.mark.parametrize("bpc", [1, 3, 4])
def test_host_addresses_match_vllm_sub_block_arithmetic(bpc):
    """Our host-side addresses per group equal vLLM's compute_sub_block_ptrs (the
    function its CUDA worker uses) for the same chunks and skip."""
    s = Setup(bpc)
    blocks, starts, chunks = CASES[bpc]
    descs = DescriptorBuilder(s.tier.layout).build(
        [b for bs in blocks for b in bs], [len(b) for b in blocks], starts,
        [c for cs in chunks for c in cs], to_host=True)
    dst = descs.dst.numpy()
    offset = 0
    for g in range(2):
        for ref in s.refs[g]:
            n = len(blocks[g])
            ours = dst[offset:offset + n]
            theirs = np.empty(n, dtype=np.uint64)
            compute_sub_block_ptrs(np.asarray(chunks[g]), bpc, theirs, s.tier.host[ref.region],
                                   skip_count=starts[g] % bpc)
            assert ours.astype(np.uint64).tolist() == theirs.tolist()
            offset += n
    assert offset == len(descs)


def test_bad_job_is_refused_before_any_byte_moves():
    s = Setup(4)
    before = [h.clone() for h in s.tier.host]
    bad = [
        job([[3, 20], []], [0, 0], [[1], []]),        # engine block 20 of 20
        job([[3, 4], []], [0, 0], [[12], []]),        # host chunk 12 of 12
        job([[3, 4], []], [3, 0], [[1], []]),         # starts in slot 3: needs two chunks
        job([[3], [4]], [0, 0], [[1], [2, 5]]),       # a chunk too many
    ]
    for k, (src, dst) in enumerate(bad):
        with pytest.raises(OffloadJobError, match=f"KV offloading: store job {k} refused, no byte moved"):
            s.worker.submit_store(k, src, dst)
    mismatched = GPULoadStoreSpec([3, 4], [2], [0])  # one group size for two groups
    with pytest.raises(OffloadJobError, match="for 2 offloaded cache groups"):
        s.worker.submit_store(9, mismatched, CPULoadStoreSpec([1]))
    assert all(torch.equal(a, b) for a, b in zip(before, s.tier.host))
    assert s.worker.get_finished() == []


def test_failed_copy_is_an_error_never_a_finished_job(monkeypatch):
    s = Setup(1)
    src, dst = job([[3], [4]], [0, 0], [[1], [2]])

    def broken_copy(*args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(copiers, "_copy", broken_copy)
    with pytest.raises(OffloadJobError, match=r"store job 5 \(3 copies, 8048 bytes\) failed: injected"):
        s.worker.submit_store(5, src, dst)
    assert s.worker.get_finished() == []


def test_worker_shutdown_releases_the_tier():
    s = Setup(2)
    s.worker.wait({1, 2})  # nothing pending: returns
    s.worker.shutdown()
    assert s.tier.host == [] and s.tier.engine == []


def test_unaddressable_kv_tensors_fail_at_start_up():
    refs = [[GroupRef(0, 512)]]
    strided = torch.zeros(8, 2, 512, dtype=torch.int8)[:, 0, :256]  # 256-byte blocks
    with pytest.raises(OffloadConfigError, match="page_size_bytes 512 does not fit a block of 256"):
        build_host_tier([strided], [512], refs, 4, 1)
    noncontig = torch.zeros(8, 16, 32, dtype=torch.int8).transpose(1, 2)
    with pytest.raises(OffloadConfigError, match="a block is not contiguous.*kv_cache_layout LBHNC"):
        build_host_tier([noncontig], [512], refs, 4, 1)
    ok = torch.zeros(8, 512, dtype=torch.int8)
    with pytest.raises(OffloadConfigError, match="page of 600 bytes does not fit"):
        build_host_tier([ok], [512], [[GroupRef(0, 600)]], 4, 1)
    with pytest.raises(OffloadConfigError, match="names KV tensor 1 of 1"):
        build_host_tier([ok], [512], [[GroupRef(1, 512)]], 4, 1)
    with pytest.raises(OffloadConfigError, match="cache group 0 has no KV tensor"):
        build_host_tier([ok], [512], [[]], 4, 1)
    with pytest.raises(OffloadConfigError, match="KV caches on meta are not supported"):
        build_host_tier([torch.empty(8, 512, dtype=torch.int8, device="meta")], [512], refs, 4, 1)


def test_spec_refuses_kv_caches_of_other_cache_groups_at_start_up():
    spec = KvopsOffloadingSpec(offloading_config({"num_cpu_blocks": 4}))  # one group
    tensor = torch.zeros(8, 512, dtype=torch.int8)
    two_groups = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 512)],
                                   [[CanonicalKVCacheRef(0, 512)], [CanonicalKVCacheRef(0, 512)]])
    with pytest.raises(OffloadConfigError, match="KV tensors for 2 cache groups, the offloading config names 1"):
        spec.get_worker(two_groups)
    one_group = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 512)], [[CanonicalKVCacheRef(0, 512)]])
    worker = spec.get_worker(one_group)
    assert isinstance(worker, KvopsOffloadingWorker) and spec.get_worker(one_group) is worker
    assert [h.shape for h in worker.tier.host] == [(4, 512)]  # num_cpu_blocks rows
    worker.shutdown()


def offloading_config(extra, blocks_per_chunk=1, bytes_per_block=4 * 32768):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=False,
        extra_config=extra, engine_id="e0", model=OffloadingModelConfig("m", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def test_spec_sizes_the_tier_from_either_setting():
    by_bytes = KvopsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 10 * 131072 + 5}))
    assert by_bytes.num_chunks == 10
    by_blocks = KvopsOffloadingSpec(offloading_config({"num_cpu_blocks": 10}, blocks_per_chunk=3))
    assert by_blocks.num_chunks == 10
    assert by_blocks.get_manager() is by_blocks.get_manager()


@pytest.mark.parametrize("extra, message", [
    ({}, "needs exactly one of 'cpu_bytes_to_use'.*'num_cpu_blocks'.*neither"),
    ({"cpu_bytes_to_use": 1 << 20, "num_cpu_blocks": 4}, "exactly one of"),
    ({"num_cpu_blocks": 0}, "'num_cpu_blocks' must be a positive integer, got 0"),
    ({"cpu_bytes_to_use": "lots"}, "'cpu_bytes_to_use' must be a positive integer, got 'lots'"),
    ({"cpu_bytes_to_use": 1000}, "'cpu_bytes_to_use' = 1000 holds no chunk: one chunk of 1 blocks takes 131072"),
    ({"cpu_bytes_to_use": 1 << 20, "canonical_layout": True}, "'canonical_layout'"),
])
def test_bad_spec_settings_fail_at_start_up_naming_the_setting(extra, message):
    config = offloading_config(extra)
    if extra.get("canonical_layout"):
        config = dataclasses.replace(config, canonical_layout=True)
    with pytest.raises(OffloadConfigError, match=message):
        KvopsOffloadingSpec(config)


def test_results_carry_bytes_and_seconds_for_vllm_metrics():
    s = Setup(1)
    src, dst = job([[3], [4]], [0, 0], [[1], [2]])
    s.worker.submit_store(1, src, dst)
    s.worker.submit_load(2, dst, src)
    results = s.worker.get_finished()
    assert [type(r) for r in results] == [TransferResult, TransferResult]
    assert [(r.job_id, r.transfer_size) for r in results] == [(1, 3000 * 2 + 2048), (2, 3000 * 2 + 2048)]
    assert all(r.transfer_time is not None for r in results)


def test_bench_offload_scenario_times_a_checked_job():
    from torch_kvops.bench import offload as offload_bench

    row = offload_bench.scenario(2048, layers=2, blocks=3, device=torch.device("cpu"), repeats=2)
    assert row["descriptors"] == 6 and row["bytes"] == 6 * 2048
    assert set(row["seconds"]) == {"store", "load", "contiguous"}
    assert row["store_vs_limit"] > 0 and row["load_vs_limit"] > 0 and row["descriptor_build_us"] > 0

"""kvops::block_digests (the integrity check's "checksum" mode): opcheck, the values
against a pure-Python CRC-32C, validation before any byte is read, GIL released."""
import sys
import threading
import time

import pytest
import torch

import torch_kvops  # noqa: F401  (loads the ops)

pytestmark = [pytest.mark.unit]


def crc32c(data: bytes, crc: int) -> int:
    """Bitwise CRC-32C (reflected polynomial 0x82F63B78) from a raw start value."""
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc


def lane_init(seed: int, lane: int) -> int:
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + lane + 1) & mask
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 29
    return (x & 0xFFFFFFFF) ^ 0xFFFFFFFF


def reference(block: bytes, seed: int) -> bytes:
    """Four CRC-32C lanes over the block's quarters (whole 8-byte words; the last
    quarter takes the remainder), as csrc/cpu/block_digests.cpp documents."""
    quarter = len(block) // 4 // 8 * 8
    parts = [block[k * quarter:(k + 1) * quarter] for k in range(3)] + [block[3 * quarter:]]
    return b"".join((crc32c(p, lane_init(seed, k)) ^ 0xFFFFFFFF).to_bytes(4, "little")
                    for k, p in enumerate(parts))


@pytest.mark.parametrize("block_bytes", [4, 36, 100, 1024])
def test_values_match_the_reference(block_bytes):
    g = torch.Generator().manual_seed(block_bytes)
    cache = torch.randint(0, 256, (6, block_bytes), dtype=torch.uint8, generator=g)
    ids = torch.tensor([5, 0, 3, 3])
    got = torch.ops.kvops.block_digests(cache, ids, 7)
    assert got.shape == (4, 16) and got.dtype == torch.uint8
    assert torch.equal(got, torch.ops.kvops.block_digests(cache, ids, 7, True))
    for k, b in enumerate(ids.tolist()):
        assert bytes(got[k].tolist()) == reference(bytes(cache[b].tolist()), 7)


def test_seed_and_every_byte_count():
    cache = torch.randn(3, 2, 64)
    ids = torch.arange(3)
    a = torch.ops.kvops.block_digests(cache, ids, 0)
    assert not torch.equal(a, torch.ops.kvops.block_digests(cache, ids, 1))
    for pos in (0, 37, 127):  # first, middle, last element of block 1
        changed = cache.clone()
        changed.view(3, -1)[1, pos] += 1.0
        b = torch.ops.kvops.block_digests(changed, ids, 0)
        assert torch.equal(b[0], a[0]) and not torch.equal(b[1], a[1]) and torch.equal(b[2], a[2])


def test_strided_blocks():
    """Blocks that lie apart (a view of every other block) hash as their copies do."""
    base = torch.randn(8, 256)
    view = base[::2]
    ids = torch.tensor([0, 3])
    assert torch.equal(torch.ops.kvops.block_digests(view, ids, 2),
                       torch.ops.kvops.block_digests(view.contiguous(), ids, 2))


def test_opcheck():
    cache = torch.randn(8, 4, 16)
    for parallel in (False, True):
        torch.library.opcheck(torch.ops.kvops.block_digests.default,
                              (cache, torch.tensor([1, 6, 2]), 3, parallel))


def test_bad_input_is_refused_with_a_clear_error():
    cache = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvops.block_digests(cache, torch.tensor([0, 4]), 0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvops.block_digests(cache, torch.tensor([-1]), 0)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.kvops.block_digests(cache, torch.tensor([0], dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvops.block_digests(torch.randn(4, 16, 2)[:, :, 0], torch.tensor([0]), 0)


def iterations_of_another_thread_during(fn) -> int:
    """How often a second Python thread ran in the middle half of ``fn``'s call (none
    when ``fn`` holds the GIL throughout: the switch interval is checked only in Python)."""
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
    return sum(lo < s < hi for s in stamps)


def test_the_gil_is_released_while_hashing():
    """The producer's sender thread writes the next layer while the digest worker hashes."""
    cache = torch.randn(1024, 4096)  # 16 MiB, hashed 16 times in one call
    ids = torch.arange(1024).repeat(16)
    assert iterations_of_another_thread_during(lambda: torch.ops.kvops.block_digests(cache, ids, 0)) > 0
    # the control: a call that holds the GIL lets the other thread run not once
    blob = bytes(256 << 20)
    assert iterations_of_another_thread_during(lambda: blob.count(b"x")) == 0

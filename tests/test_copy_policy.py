"""The CUDA copy policy and kernel-launch planning, tested without a GPU through the
private hook ``_C._plan_cuda_copy`` (the CUDA backend executes exactly this plan)."""
import os
import subprocess
import sys

import pytest
import torch

import torch_kvops
from torch_kvops import _C

pytestmark = [pytest.mark.process]

K = _C._kernel_constants()
KIB = 1024


def plan(descs, **kw):
    """descs: list of (src, dst, bytes) with made-up addresses (never dereferenced)."""
    s = torch.tensor([d[0] for d in descs], dtype=torch.int64)
    d = torch.tensor([d[1] for d in descs], dtype=torch.int64)
    n = torch.tensor([d[2] for d in descs], dtype=torch.int64)
    return _C._plan_cuda_copy(s, d, n, **kw)


def fragmented(count, size, src_base=1 << 32, dst_base=1 << 40):
    # Every other block: never adjacent, so nothing merges.
    return [(src_base + 2 * k * size, dst_base + 2 * k * size, size) for k in range(count)]


@pytest.fixture(autouse=True)
def restore_policy():
    old = torch_kvops.get_copy_policy()
    yield
    torch_kvops.set_copy_policy(**old)


def test_defaults_are_the_documented_ones():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOPS_CUDA_")}
    out = subprocess.run([sys.executable, "-c", "import torch_kvops; print(torch_kvops.get_copy_policy())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert eval(out) == {"mode": "auto", "max_ctas": 128, "dma_min_bytes": 256 * KIB,
                         "dma_min_bytes_d2d": 16 * KIB * KIB}


def test_small_descriptors_take_the_kernel_large_runs_take_dma():
    descs = fragmented(4, 16 * KIB) + [(1 << 45, 1 << 46, 256 * KIB), (1 << 47, 1 << 48, 256 * KIB - 1)]
    p = plan(descs)
    assert p["paths"] == ["kernel"] * 4 + ["dma", "kernel"]
    assert p["dma"] == [(1 << 45, 1 << 46, 256 * KIB)]
    assert p["kernel_bytes"] == 4 * 16 * KIB + 256 * KIB - 1 and p["dma_bytes"] == 256 * KIB


def test_adjacent_blocks_merge_before_the_choice():
    # 16 adjacent 16 KiB blocks form one 256 KiB run: DMA reaches the link there.
    run = [(1000 + k * 16 * KIB, 9000 + k * 16 * KIB, 16 * KIB) for k in range(16)]
    p = plan(run)
    assert p["descs"] == [(1000, 9000, 256 * KIB)] and p["paths"] == ["dma"]
    p = plan(run[:15])
    assert p["paths"] == ["kernel"]


def test_without_batched_dma_host_copies_take_the_kernel_at_every_size():
    """On the legacy default stream DMA is one cudaMemcpyAsync per descriptor (H200:
    33.9 GB/s for 256 KiB runs, the kernel 47.7): auto takes the kernel there.
    Device-to-device copies keep their threshold; forced DMA stays DMA."""
    run = [(1000 + k * 16 * KIB, 9000 + k * 16 * KIB, 16 * KIB) for k in range(16)]
    big = [(1 << 45, 1 << 46, 64 * KIB * KIB)]
    assert plan(run + big)["paths"] == ["dma", "dma"]
    p = plan(run + big, dma_batched=False)
    assert p["paths"] == ["kernel", "kernel"] and p["dma_bytes"] == 0
    assert plan(big, dma_batched=False, device_to_device=True)["paths"] == ["dma"]
    assert plan(run, dma_batched=False, mode="dma")["paths"] == ["dma"]
    # memory a kernel cannot address (pageable host) still goes to DMA
    assert plan(run, dma_batched=False, src_kernel_ok=False)["paths"] == ["dma"]


def test_device_to_device_threshold_is_separate():
    big = [(1 << 40, 1 << 41, 1 << 20)]
    assert plan(big, device_to_device=False)["paths"] == ["dma"]
    assert plan(big, device_to_device=True)["paths"] == ["kernel"]
    assert plan([(1 << 40, 1 << 41, 16 << 20)], device_to_device=True)["paths"] == ["dma"]


@pytest.mark.parametrize("side", ["src", "dst"])
def test_memory_a_kernel_cannot_address_goes_to_dma_in_every_mode(side):
    descs = fragmented(3, 2 * KIB)
    for mode in ("auto", "kernel", "dma"):
        p = plan(descs, mode=mode, **{f"{side}_kernel_ok": False})
        assert p["paths"] == ["dma"] * 3, mode
        assert p["launches"] == [] and p["items"] == []


def test_forced_modes():
    descs = fragmented(2, 2 * KIB) + [(1 << 45, 1 << 46, 4 << 20)]
    assert plan(descs, mode="kernel")["paths"] == ["kernel"] * 3
    assert plan(descs, mode="dma")["paths"] == ["dma"] * 3
    assert plan(descs, mode="auto")["paths"] == ["kernel", "kernel", "dma"]


def test_thresholds_from_arguments():
    descs = fragmented(2, 32 * KIB)
    assert plan(descs, dma_min_bytes=32 * KIB)["paths"] == ["dma", "dma"]
    assert plan(descs, dma_min_bytes=32 * KIB + 1)["paths"] == ["kernel", "kernel"]


def test_large_descriptors_are_cut_into_items_that_keep_alignment():
    size = 3 * K["item_bytes"] + 5
    p = plan([(0x1003, 0x200007, size)], mode="kernel")
    assert [i[2] for i in p["items"]] == [K["item_bytes"]] * 3 + [5]
    for k, (s, d, n) in enumerate(p["items"]):
        assert s == 0x1003 + k * K["item_bytes"] and d == 0x200007 + k * K["item_bytes"]
        assert (s % 16, d % 16) == (0x3, 0x7)  # offsets are multiples of 16: same misalignment


def test_one_by_value_launch_when_it_fits():
    n = K["items_by_value_large"]
    p = plan(fragmented(n, 2 * KIB))
    assert p["launches"] == [{"first_item": 0, "items": n, "grid": 128, "by_value": True}]
    p = plan(fragmented(40, 2 * KIB))
    assert p["launches"] == [{"first_item": 0, "items": 40, "grid": 5, "by_value": True}]  # 8 warps a block


def test_small_parameter_limit_on_old_cuda():
    n = K["items_by_value_small"]
    assert K["items_by_value_small"] * 24 + 8 <= 4096 and K["items_by_value_large"] * 24 + 8 <= 32764
    p = plan(fragmented(n, 2 * KIB), large_params=False)
    assert len(p["launches"]) == 1 and p["launches"][0]["by_value"]
    p = plan(fragmented(n + 1, 2 * KIB), large_params=False)
    assert p["launches"] == [{"first_item": 0, "items": n + 1, "grid": 22, "by_value": False}]


def test_many_descriptors_upload_once_eagerly_and_split_under_capture():
    count = 100_000
    descs = fragmented(count, 2 * KIB)
    eager = plan(descs)
    assert eager["launches"] == [{"first_item": 0, "items": count, "grid": 128, "by_value": False}]
    captured = plan(descs, capturing=True)
    per = K["items_by_value_large"]
    assert all(l["by_value"] for l in captured["launches"])
    assert len(captured["launches"]) == -(-count // per)
    covered = [(l["first_item"], l["items"]) for l in captured["launches"]]
    assert covered[0] == (0, per) and covered[-1] == (per * (len(covered) - 1), count - per * (len(covered) - 1))
    assert sum(n for _, n in covered) == count
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))


def test_grid_respects_the_budget():
    descs = fragmented(1000, 2 * KIB)
    assert plan(descs, max_ctas=7)["launches"][0]["grid"] == 7
    assert plan(descs[:3], max_ctas=7)["launches"][0]["grid"] == 1


def test_zero_byte_descriptors_copy_nothing():
    p = plan([(1 << 30, 1 << 31, 0)] + fragmented(1, 64))
    assert p["items"] == [(1 << 32, 1 << 40, 64)]


def test_set_copy_policy_validates_and_returns_the_previous_one():
    before = torch_kvops.set_copy_policy("dma", max_ctas=64)
    assert torch_kvops.get_copy_policy()["mode"] == "dma"
    assert torch_kvops.get_copy_policy()["max_ctas"] == 64
    assert plan(fragmented(2, 2 * KIB))["paths"] == ["dma", "dma"]  # the hook uses the current policy
    with pytest.raises(RuntimeError, match="not one of auto, kernel, dma"):
        torch_kvops.set_copy_policy("fast")
    with pytest.raises(RuntimeError, match="max_ctas"):
        torch_kvops.set_copy_policy(max_ctas=0)
    with pytest.raises(RuntimeError, match="dma_min_bytes must be >= 0"):
        torch_kvops.set_copy_policy(dma_min_bytes=-1)
    assert torch_kvops.get_copy_policy()["mode"] == "dma"  # unchanged by the rejected calls
    torch_kvops.set_copy_policy(**before)
    assert torch_kvops.get_copy_policy() == before


@pytest.mark.parametrize("env, message", [
    ({"KVOPS_CUDA_COPY": "kernel", "KVOPS_CUDA_COPY_MAX_CTAS": "12",
      "KVOPS_CUDA_DMA_MIN_BYTES": "4096", "KVOPS_CUDA_DMA_MIN_BYTES_D2D": "8192"}, None),
    ({"KVOPS_CUDA_COPY": "turbo"}, "is not one of auto, kernel, dma"),
    ({"KVOPS_CUDA_COPY_MAX_CTAS": "0"}, "must be in"),
    ({"KVOPS_CUDA_DMA_MIN_BYTES": "1k"}, "is not a non-negative integer"),
])
def test_environment(env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if message is None:
        assert _C._copy_policy_from_env() == {"mode": "kernel", "max_ctas": 12, "dma_min_bytes": 4096,
                                             "dma_min_bytes_d2d": 8192}
    else:
        with pytest.raises(RuntimeError, match=message):
            _C._copy_policy_from_env()

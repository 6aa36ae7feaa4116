"""KV offload and reload with one batched call per direction.

    .venv/bin/python examples/offload.py

Uses the GPU when there is one (host side pinned), the CPU otherwise.
"""
import torch

import torch_kvops  # noqa: F401  registers torch.ops.kvops

device = "cuda" if torch.cuda.is_available() else "cpu"
layers, device_blocks, host_blocks, block_shape = 8, 256, 1024, (2, 16, 8, 64)
device_caches = [torch.randn(device_blocks, *block_shape, device=device) for _ in range(layers)]
host_caches = [torch.zeros(host_blocks, *block_shape, pin_memory=device == "cuda") for _ in range(layers)]

# Offload device blocks 10..41 (one run: merged into one descriptor per layer) and a few
# scattered ones into host blocks chosen by the offload manager.
mapping = torch.tensor([[b, 500 + i] for i, b in enumerate(list(range(10, 42)) + [77, 3, 190])])
torch.ops.kvops.swap_blocks_batch(device_caches, host_caches, mapping)

# Later: reload them into other free device blocks.
reload = torch.stack([mapping[:, 1], torch.arange(100, 100 + len(mapping))], dim=1)
torch.ops.kvops.swap_blocks_batch(host_caches, device_caches, reload)
if device == "cuda":
    torch.cuda.current_stream().synchronize()

for layer in range(layers):
    assert torch.equal(device_caches[layer][100:100 + len(mapping)], device_caches[layer][mapping[:, 0]])
print(f"offloaded and reloaded {len(mapping)} blocks x {layers} layers on {device}: OK")

try:  # bad input is rejected before any byte moves
    torch.ops.kvops.swap_blocks_batch(device_caches, host_caches, torch.tensor([[0, host_blocks]]))
except RuntimeError as err:
    print("rejected:", str(err).splitlines()[0])

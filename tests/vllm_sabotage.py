"""Fault injection for the vLLM P/D tests, installed in the engine processes by the
test (``Engine(..., setup="vllm_sabotage:install")``), never part of the product.

The prefill engine's pushes are sabotaged while the file named by
``KVOPS_SABOTAGE_FILE`` holds a mode (the test writes it between requests):

- ``drop``: the transport reports success and moves no byte;
- ``shift``: every write lands 4 KiB past its destination (transport level: into the
  neighbouring bytes, whether the write goes to a staging slot or to the cache);
- ``rotate``: the worker is handed destination blocks rotated by one within each
  chunk (a wrong block id in the plan; the consumer accepts it, the bytes land in
  the wrong blocks of the right request).
"""
import os


def mode() -> str:
    path = os.environ.get("KVOPS_SABOTAGE_FILE")
    if not path:
        raise RuntimeError("KVOPS_SABOTAGE_FILE is not set in the engine process")
    with open(path) as f:
        return f.read().strip()


def install(process_name: str) -> None:
    if process_name != "prefill":
        return
    from torch_kvops.integrations.vllm import worker as vllm_worker
    from torch_kvops.transports.mooncake import MooncakeTransport

    write = MooncakeTransport.write

    def sabotaged_write(self, peer, src, dst, lengths, **kwargs):
        how = mode()
        if how == "drop":
            return None
        if how == "shift":
            dst = [int(d) + 4096 for d in dst]
        return write(self, peer, src, dst, lengths, **kwargs)

    begin_step = vllm_worker.KvopsWorker.begin_step

    def sabotaged_begin_step(self, meta):
        if mode() == "rotate":
            for push in meta.push:
                push.dst_blocks = push.dst_blocks[1:] + push.dst_blocks[:1]
        return begin_step(self, meta)

    MooncakeTransport.write = sabotaged_write
    vllm_worker.KvopsWorker.begin_step = sabotaged_begin_step

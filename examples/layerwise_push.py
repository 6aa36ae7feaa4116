"""Layer-wise KV push between two processes over Mooncake TCP on loopback.

    .venv/bin/python examples/layerwise_push.py

The decode side (consumer) runs in a child process; this process is the prefill side
(producer). Each "layer" writes its KV blocks and calls save_kv_layer, which pushes the
layer while the next one computes.
"""
import multiprocessing as mp

import torch

LAYERS, BLOCKS, BLOCK_SHAPE = 8, 128, (2, 16, 4, 64)


def decode_side(pipe):
    from torch_kvops import LayerwiseConnector, MooncakeTransport

    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    transport = MooncakeTransport(host="127.0.0.1")
    conn = LayerwiseConnector("consumer", transport)
    conn.register_kv_caches(caches)
    pipe.send(conn.peer_info())
    req_id, dst_blocks = pipe.recv()
    conn.expect(req_id)  # before the push: a push for an id nobody expected is refused
    pipe.send("expected")
    finished = set()
    while req_id not in finished:
        done, failed = conn.get_finished()
        if req_id in failed:
            raise RuntimeError("transfer failed; the engine would recompute")
        finished |= done
    pipe.send([c[dst_blocks].clone() for c in caches])
    conn.close()
    transport.close()


def main():
    from torch_kvops import LayerwiseConnector, MooncakeTransport, TransferRequest

    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child,))
    proc.start()
    info = pipe.recv()

    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    transport = MooncakeTransport(host="127.0.0.1")
    with LayerwiseConnector("producer", transport) as conn:
        conn.register_kv_caches(caches)
        peer = conn.add_peer(info)
        src_blocks, dst_blocks = [4, 5, 6, 7, 30], [90, 91, 92, 93, 11]
        pipe.send(("req-1", dst_blocks))
        assert pipe.recv() == "expected"  # as an engine's decode side asks for the KV it awaits
        conn.start_step([TransferRequest("req-1", peer, src_blocks, dst_blocks)])
        x = torch.randn(len(src_blocks), *BLOCK_SHAPE)
        for layer, cache in enumerate(caches):  # the "model"
            x = torch.tanh(x * 1.1)
            cache.index_copy_(0, torch.tensor(src_blocks), x)  # this layer's KV write
            conn.save_kv_layer(layer, cache)                    # push it now
        conn.wait_for_save(timeout=60)
        received = pipe.recv()
        for layer in range(LAYERS):
            assert torch.equal(received[layer], caches[layer][src_blocks])
        print("decode side holds the prefill side's bytes for every layer:", conn.stats()["bytes_sent"], "bytes")
    transport.close()
    proc.join(30)


if __name__ == "__main__":
    main()

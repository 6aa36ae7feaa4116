"""Minimal P/D proxy for `vllm serve` engines running KvopsLayerwiseConnector.

For each /v1/completions request it picks a transfer id, sends the request to the
decode engine first (``do_remote_prefill``; D allocates blocks and posts them to P's
side channel), then a one-token copy to the prefill engine (``do_remote_decode``; P
pushes each layer into D's blocks while it prefills), and returns D's answer (streamed
if the client asked for it). P's answer is read and dropped: it only frees P's request.

    python examples/vllm_proxy.py --prefill http://127.0.0.1:8100 \\
        --prefill-side-channel 127.0.0.1:7100 --decode http://127.0.0.1:8200 --port 8000

Every upstream call has a timeout (--timeout). One prefill and one decode instance;
a real router would pick among several.
"""
from __future__ import annotations

import argparse
import asyncio
import uuid

import aiohttp
from aiohttp import web


def make_app(args: argparse.Namespace) -> web.Application:
    timeout = aiohttp.ClientTimeout(total=args.timeout)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tid = f"kvops-{uuid.uuid4().hex}"
        decode_body = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid,
            "kvops_producer": args.prefill_side_channel})
        prefill_body = dict(body, max_tokens=1, stream=False,
                            kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        prefill_body.pop("stream_options", None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # D first, P right after, without waiting for D's answer (D answers only once
            # P's KV landed): P waits (bounded) for D's destination if it is faster.
            decode_call = asyncio.create_task(
                session.post(f"{args.decode}/v1/completions", json=decode_body))
            await asyncio.sleep(0)  # let D's request go out first
            prefill = asyncio.create_task(_drain(session, f"{args.prefill}/v1/completions",
                                                 prefill_body))
            try:
                decode = await decode_call
            except BaseException:
                await prefill  # never leave the prefill call running
                raise
            try:
                response = web.StreamResponse(status=decode.status,
                                              headers={"Content-Type": decode.content_type})
                await response.prepare(request)
                async for chunk in decode.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            finally:
                decode.release()
                status = await prefill  # never leave the prefill call running
            if status != 200:
                print(f"[proxy] prefill engine answered {status} for {tid}")
            return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _drain(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    async with session.post(url, json=body) as resp:
        await resp.read()
        return resp.status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="prefill engine base URL")
    ap.add_argument("--prefill-side-channel", required=True,
                    help="host:port of the prefill engine's kvops side channel "
                         "(kv_connector_extra_config side_channel_host/port)")
    ap.add_argument("--decode", required=True, help="decode engine base URL")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    web.run_app(make_app(args), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()

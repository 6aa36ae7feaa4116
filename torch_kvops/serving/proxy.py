"""P/D proxy for vLLM API servers running KvopsLayerwiseConnector.

    python -m torch_kvops.serving.proxy --prefill URL[,URL] --prefill-side-channel HOST:PORT[,...]
        --decode URL[,URL] [--port 8000] [--order d-first|concurrent|p-first]

For each ``/v1/completions`` or ``/v1/chat/completions`` request it picks the P and the D
with the fewest requests in flight, a transfer id T, and sends

- D the request with ``kv_transfer_params = {do_remote_prefill, transfer_id: T,
  kvops_producer: <P's side channel>}`` (D allocates blocks and posts them to P);
- P a copy with ``max_tokens=1``, ``stream=false`` and ``{do_remote_decode, transfer_id: T}``
  (P pushes each layer into D's blocks while it prefills); P's answer is read and dropped.

``--order``: ``d-first`` (D, then P without waiting), ``concurrent`` (both at once) or
``p-first`` (P's whole answer, then D: how vllm-router orders them). D's answer goes to
the client as it comes (streamed if asked), with D's ``kv_transfer_params`` (non-streaming:
``kvops_local_prompt_tokens`` = prompt tokens D computed itself).

Before the first byte went to the client, a failed P or D (connection refused or reset,
a 5xx answer) is marked down for ``--down-s`` and the pair is retried on other instances
with a new transfer id (``--retries``). A client that disconnects cancels the request:
the proxy closes its connections to P and D, and vLLM aborts the request on both.
Every upstream call has a timeout. ``/health`` answers 200; ``/metrics`` gives the
proxy's counters (Prometheus text).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from typing import List, Optional

import aiohttp
from aiohttp import web

from .upstreams import Instance, Pool, parse_instances

log = logging.getLogger("torch_kvops.serving.proxy")
ORDERS = ("d-first", "concurrent", "p-first")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class UpstreamFailed(Exception):
    """P or D failed before the client got a byte: the pair may be retried."""

    def __init__(self, instance: Instance, role: str, reason: str) -> None:
        super().__init__(f"{role} {instance.url}: {reason}")
        self.instance, self.role = instance, role


class Proxy:
    """The proxy's state: instance pools, options, counters."""

    def __init__(self, prefill: List[Instance], decode: List[Instance], *, order: str = "d-first",
                 timeout: float = 600.0, connect_timeout: float = 5.0, retries: int = 2,
                 down_s: float = 5.0, send_decode_params: bool = True,
                 abort_on_disconnect: bool = True) -> None:
        if order not in ORDERS:
            raise ValueError(f"order {order!r} is not one of {ORDERS}")
        if any(p.side_channel is None for p in prefill):
            raise ValueError("every prefill instance needs its side channel (HOST:PORT)")
        self.prefill = Pool("prefill", prefill, down_s)
        self.decode = Pool("decode", decode, down_s)
        self.order = order
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self.retries = retries
        # False only for the negative control: D then computes the whole prompt itself
        self.send_decode_params = send_decode_params
        # False only for the negative control: a client's leaving then aborts nothing
        # (P and D compute the request to its end)
        self.abort_on_disconnect = abort_on_disconnect
        self.counters = {"requests": 0, "retries": 0, "failed": 0, "client_disconnects": 0,
                         "prefill_errors_after_answer": 0}
        self.session: Optional[aiohttp.ClientSession] = None
        # P's calls still running after D's answer went out (bounded by the timeout)
        self.pending_prefills: set = set()

    async def start(self, app: web.Application) -> None:
        # no connection pooling limits: each request holds two upstream connections
        self.session = aiohttp.ClientSession(timeout=self.timeout,
                                             connector=aiohttp.TCPConnector(limit=0))

    async def close(self, app: web.Application) -> None:
        for task in list(self.pending_prefills):
            task.cancel()
        await asyncio.gather(*self.pending_prefills, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def bodies(self, body: dict, tid: str, producer: Instance) -> tuple:
        decode_body = dict(body)
        if self.send_decode_params:
            decode_body["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": tid,
                                                 "kvops_producer": producer.side_channel}
        prefill_body = dict(body, max_tokens=1, stream=False,
                            kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        return decode_body, prefill_body

    async def call_prefill(self, p: Instance, path: str, body: dict) -> tuple:
        """P's whole answer: (status, body bytes); UpstreamFailed on a connection error."""
        try:
            async with self.session.post(p.url + path, json=body) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed(p, "prefill", repr(exc)) from exc

    async def open_decode(self, d: Instance, path: str, body: dict) -> tuple:
        """D's response and its first chunk of body (the first token, once P's KV landed)."""
        try:
            resp = await self.session.post(d.url + path, json=body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamFailed(d, "decode", repr(exc)) from exc
        try:
            if resp.status >= 500:
                text = (await resp.read())[:300]
                raise UpstreamFailed(d, "decode", f"status {resp.status}: {text!r}")
            first = await resp.content.readany()
            return resp, first
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            resp.close()
            raise UpstreamFailed(d, "decode", repr(exc)) from exc
        except BaseException:
            resp.close()  # closing the connection makes vLLM abort the request
            raise

    async def attempt(self, p: Instance, d: Instance, path: str, body: dict, tid: str) -> tuple:
        """One try of the pair, up to D's first chunk: (D's response, first chunk, P's task).
        On failure or cancellation nothing is left running."""
        decode_body, prefill_body = self.bodies(body, tid, p)
        prefill_task: Optional[asyncio.Task] = None
        decode_task: Optional[asyncio.Task] = None
        try:
            if self.order == "p-first":
                status, text = await self.call_prefill(p, path, prefill_body)
                if status >= 500:
                    raise UpstreamFailed(p, "prefill", f"status {status}: {text[:300]!r}")
                if status != 200:  # the client's error: D would refuse it too
                    return None, (status, text), None
                prefill_task = asyncio.get_running_loop().create_future()
                prefill_task.set_result((status, text))
                decode_task = asyncio.create_task(self.open_decode(d, path, decode_body))
            elif self.order == "d-first":
                decode_task = asyncio.create_task(self.open_decode(d, path, decode_body))
                await asyncio.sleep(0)  # D's request goes out first
                prefill_task = asyncio.create_task(self.call_prefill(p, path, prefill_body))
            else:
                prefill_task = asyncio.create_task(self.call_prefill(p, path, prefill_body))
                decode_task = asyncio.create_task(self.open_decode(d, path, decode_body))
            # D's first chunk, unless P fails before it: then D waits for KV that never comes
            while not decode_task.done():
                await asyncio.wait([decode_task, prefill_task], return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and not decode_task.done():
                    status, text = prefill_task.result()  # raises UpstreamFailed
                    if status >= 500:
                        raise UpstreamFailed(p, "prefill", f"status {status}: {text[:300]!r}")
                    break  # P answered: D's first token follows
            resp, first = await decode_task
            return resp, first, prefill_task
        except BaseException:
            for task in (decode_task, prefill_task):
                if task is not None and not task.done():
                    task.cancel()
            for task in (decode_task, prefill_task):
                if isinstance(task, asyncio.Task):
                    await asyncio.gather(task, return_exceptions=True)
                    if task.done() and not task.cancelled() and task.exception() is None \
                            and task is decode_task:
                        task.result()[0].close()
            raise

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": f"request body is not JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        self.counters["requests"] += 1
        path = request.path
        tried_p: List[Instance] = []
        tried_d: List[Instance] = []
        errors: List[str] = []
        for attempt in range(self.retries + 1):
            p = self.prefill.pick(tried_p) or self.prefill.pick()
            d = self.decode.pick(tried_d) or self.decode.pick()
            tid = f"kvops-{uuid.uuid4().hex}"
            p.in_flight += 1
            d.in_flight += 1
            p.requests += 1
            d.requests += 1
            try:
                try:
                    resp, first, prefill_task = await self.attempt(p, d, path, body, tid)
                except UpstreamFailed as exc:
                    errors.append(str(exc))
                    log.warning("attempt %d of %s failed: %s", attempt + 1, tid, exc)
                    pool = self.prefill if exc.role == "prefill" else self.decode
                    pool.mark_down(exc.instance)
                    (tried_p if exc.role == "prefill" else tried_d).append(exc.instance)
                    if attempt < self.retries:
                        self.counters["retries"] += 1
                    continue
                self.prefill.mark_up(p)
                if resp is None:  # P refused the request (4xx): pass its answer on
                    status, text = first
                    return web.Response(status=status, body=text, content_type="application/json")
                self.decode.mark_up(d)
                return await self.relay(request, resp, first, prefill_task, tid)
            except asyncio.CancelledError:
                self.counters["client_disconnects"] += 1
                raise
            finally:
                p.in_flight -= 1
                d.in_flight -= 1
        self.counters["failed"] += 1
        return web.json_response({"error": "no prefill/decode pair answered",
                                  "attempts": errors}, status=502)

    async def relay(self, request: web.Request, resp: aiohttp.ClientResponse, first: bytes,
                    prefill_task: "asyncio.Future", tid: str) -> web.StreamResponse:
        """D's answer to the client as it comes. P's answer is checked when it is in
        (often after D's last byte): the client's leaving then no longer aborts P."""
        # the negative control's proxy goes on reading D when the client has left
        client_gone = () if self.abort_on_disconnect else (ConnectionError, OSError)
        try:
            out = web.StreamResponse(status=resp.status,
                                     headers={"Content-Type": resp.headers.get("Content-Type",
                                                                               "application/json")})
            await out.prepare(request)
            if first:
                await out.write(first)
            async for chunk in resp.content.iter_any():
                if request.transport is None or request.transport.is_closing():
                    # the client left and the handler was not cancelled (yet)
                    raise ConnectionResetError("the client closed its connection")
                await out.write(chunk)
            await out.write_eof()
        except client_gone:
            async for _ in resp.content.iter_any():  # the negative control: D runs to its end
                pass
            await asyncio.gather(prefill_task, return_exceptions=True)
        except BaseException:
            prefill_task.cancel()  # closing P's connection aborts its request
            await asyncio.gather(prefill_task, return_exceptions=True)
            raise
        finally:
            resp.close()  # before its end (the client left): vLLM aborts D's request
        self.pending_prefills.add(prefill_task)
        prefill_task.add_done_callback(lambda task: self.prefill_done(task, tid))
        return out

    def prefill_done(self, task: "asyncio.Future", tid: str) -> None:
        self.pending_prefills.discard(task)
        if task.cancelled():
            result: object = "cancelled"
        else:
            result = task.exception() or task.result()
        if isinstance(result, tuple) and result[0] == 200:
            return
        self.counters["prefill_errors_after_answer"] += 1
        log.warning("%s: prefill failed after D answered: %r", tid, result)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        for name, value in self.counters.items():
            lines += [f"# TYPE kvops_proxy_{name}_total counter", f"kvops_proxy_{name}_total {value}"]
        lines.append("# TYPE kvops_proxy_in_flight gauge")
        for pool in (self.prefill, self.decode):
            for i in pool.instances:
                lines.append(f'kvops_proxy_in_flight{{role="{pool.role}",url="{i.url}"}} {i.in_flight}')
                lines.append(f'kvops_proxy_upstream_requests_total{{role="{pool.role}",url="{i.url}"}} '
                             f'{i.requests}')
                lines.append(f'kvops_proxy_upstream_failures_total{{role="{pool.role}",url="{i.url}"}} '
                             f'{i.failures}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        for path in ENDPOINTS:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m torch_kvops.serving.proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="prefill servers' base URLs, comma-separated")
    ap.add_argument("--prefill-side-channel", required=True,
                    help="HOST:PORT of each prefill server's kvops side channel, in the order of "
                         "--prefill (kv_connector_extra_config side_channel_host/port)")
    ap.add_argument("--decode", required=True, help="decode servers' base URLs, comma-separated")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    ap.add_argument("--order", choices=ORDERS, default="d-first")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound of one upstream call, seconds")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--retries", type=int, default=2, help="retries before the first byte")
    ap.add_argument("--down-s", type=float, default=5.0, help="how long a failed instance is avoided")
    ap.add_argument("--no-decode-params", action="store_true",
                    help="negative control for tests: send D no kv_transfer_params (D computes "
                         "the whole prompt; P still prefills)")
    ap.add_argument("--no-abort-on-disconnect", action="store_true",
                    help="negative control for tests: a client's disconnect aborts nothing "
                         "(P and D compute the request to its end)")
    return ap


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(parse_instances(args.prefill, args.prefill_side_channel),
                  parse_instances(args.decode), order=args.order, timeout=args.timeout,
                  connect_timeout=args.connect_timeout, retries=args.retries, down_s=args.down_s,
                  send_decode_params=not args.no_decode_params,
                  abort_on_disconnect=not args.no_abort_on_disconnect)
    # handler_cancellation: a client's disconnect cancels its handler, which closes the
    # upstream connections (vLLM then aborts the request on P and D)
    runner = web.AppRunner(proxy.app(), handler_cancellation=proxy.abort_on_disconnect)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"kvops proxy listening on http://{args.host}:{port} (order {args.order})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        print("kvops proxy stopped", file=sys.stderr)


if __name__ == "__main__":
    main()

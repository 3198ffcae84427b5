"""A small bounded closed-loop load generator: KServe-v2 HTTP with JSON tensors (no binary
extension), and gRPC for machines without perf_analyzer. `concurrency` workers, each sending the
next request as soon as its previous one is answered, for a fixed time (after a warm-up) and at
most `max_requests` requests in all. Records every request's latency; counts failed answers and
connection errors as errors.

    python -m bench.loadgen --url 127.0.0.1:8000 --model identity_fp32 -c 16 -d 5
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bench.measure import Point


def identity_json_body(n: int = 16) -> bytes:
    import json

    data = [float(i) / 4 for i in range(n)]
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, n], "datatype": "FP32", "data": data}]}).encode()


async def closed_loop(send: Callable[[], Awaitable[bool]], concurrency: int, duration_s: float, warmup_s: float,
                      max_requests: int, request_timeout: float) -> Point:
    """`concurrency` workers calling `send()` back to back (it answers whether the request
    succeeded, or raises: counted as an error); latencies of the successful ones after the warm-up."""
    latencies: list[float] = []
    errors = 0
    sent = 0
    measuring = False
    stop = False
    first_error = None

    async def worker() -> None:
        nonlocal errors, sent, first_error
        clock = time.perf_counter
        while not stop and sent < max_requests:
            sent += 1
            t0 = clock()
            try:
                ok = await send()
            except Exception as exc:  # noqa: BLE001 - any failure of one request is an error
                ok = False
                first_error = first_error or repr(exc)
            if measuring and not stop:
                if ok:
                    latencies.append(clock() - t0)
                else:
                    errors += 1

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        measuring = True
        sent = 0
        cpu0, t_start = time.process_time(), time.perf_counter()
        deadline = t_start + duration_s
        while time.perf_counter() < deadline and sent < max_requests and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        stop = True
        elapsed = time.perf_counter() - t_start
        cpu = time.process_time() - cpu0
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), request_timeout + 5)
    finally:
        stop = True
        for t in tasks:
            t.cancel()
    if not latencies:
        raise RuntimeError(f"no successful requests ({errors} errors; first: {first_error})")
    us = np.asarray(latencies) * 1e6
    return Point(throughput=len(latencies) / elapsed, p50_us=float(np.percentile(us, 50)),
                 p90_us=float(np.percentile(us, 90)), p99_us=float(np.percentile(us, 99)), avg_us=float(us.mean()),
                 count=len(latencies), errors=errors, client_cpu=cpu / elapsed)


async def _run_http(url: str, body: bytes, concurrency: int, duration_s: float, warmup_s: float, max_requests: int,
                    request_timeout: float, check) -> Point:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # one checked request before the load: the server must answer this body correctly
        async with session.post(url, data=body, headers=headers) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"POST {url} -> {r.status}: {payload[:300]!r}")
            if check is not None:
                check(payload)

        async def send() -> bool:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status == 200

        return await closed_loop(send, concurrency, duration_s, warmup_s, max_requests, request_timeout)


async def _run_grpc(target: str, request: Any, concurrency: int, duration_s: float, warmup_s: float,
                    max_requests: int, request_timeout: float, check) -> Point:
    import grpc

    from pier.protocol import grpc_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        first = await infer(request, timeout=request_timeout)  # checked before the load; errors raise
        if check is not None:
            check(first)

        async def send() -> bool:
            await infer(request, timeout=request_timeout)
            return True

        return await closed_loop(send, concurrency, duration_s, warmup_s, max_requests, request_timeout)


def _event_loop_runner() -> Callable[[Awaitable[Point]], Point]:
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def run(url: str, body: bytes, concurrency: int, duration_s: float, warmup_s: float = 1.0,
        max_requests: int = 500_000, request_timeout: float = 30.0, check=None) -> Point:
    """HTTP JSON load in a fresh event loop (uvloop when installed)."""
    return _event_loop_runner()(_run_http(url, body, concurrency, duration_s, warmup_s, max_requests,
                                          request_timeout, check))


def run_grpc(target: str, request: Any, concurrency: int, duration_s: float, warmup_s: float = 1.0,
             max_requests: int = 500_000, request_timeout: float = 60.0, check=None) -> Point:
    """gRPC `ModelInfer` load (one prepared ModelInferRequest, sent over and over) in a fresh event
    loop; `check(response)` vets the first answer. For machines without perf_analyzer."""
    return _event_loop_runner()(_run_grpc(target, request, concurrency, duration_s, warmup_s, max_requests,
                                          request_timeout, check))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="host:port of the HTTP endpoint (loopback)")
    p.add_argument("--model", default="identity_fp32")
    p.add_argument("-c", "--concurrency", type=int, default=1)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--max-requests", type=int, default=500_000)
    args = p.parse_args()
    host = args.url.split("//")[-1].split(":")[0]
    if not (host.startswith("127.") or host in ("localhost", "[::1]")):
        raise SystemExit("loopback addresses only")
    pt = run(f"http://{args.url.split('//')[-1]}/v2/models/{args.model}/infer", identity_json_body(),
             args.concurrency, args.duration, args.warmup, args.max_requests)
    print(f"{pt.throughput:,.0f} req/s  p50 {pt.p50_us / 1000:.2f} ms  p90 {pt.p90_us / 1000:.2f} ms  "
          f"p99 {pt.p99_us / 1000:.2f} ms  n={pt.count} errors={pt.errors} client CPU {pt.client_cpu:.0%}")


if __name__ == "__main__":
    main()

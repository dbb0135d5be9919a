#!/usr/bin/env python3
"""A bounded load run against a running `loraplex serve` (or any OpenAI-compatible server):
REQUESTS completions from CONCURRENCY keep-alive connections (asyncio, no dependencies), the
model of each drawn round-robin from --models, then it stops and prints one JSON object:
requests/s, generated tokens/s, end-to-end latency and (with --stream) time-to-first-token
percentiles, and the count of failed requests.

usage: serve_load.py URL [--requests N] [--concurrency C] [--max-tokens T] [--stream]
                         [--models base,sql,...] [--prompt TEXT] [--api-key KEY]
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from urllib.parse import urlparse


def percentile(values, p):
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100.0 * (len(ordered) - 1))))
    return ordered[k]


async def read_response(reader, on_chunk):
    """Reads one HTTP/1.1 response (Content-Length or chunked); returns (status, body, whether
    the server closes the connection after it)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).strip().split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            on_chunk(data)
            body += data
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        on_chunk(body)
    return status, body, headers.get("connection", "").lower() == "close"


async def worker(args, host, port, path, jobs, results):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while True:
            try:
                i = jobs.get_nowait()
            except asyncio.QueueEmpty:
                return
            models = args.models.split(",")
            body = {"model": models[i % len(models)], "prompt": args.prompt,
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            if args.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            data = json.dumps(body).encode()
            auth = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
            request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
                       f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                       ).encode() + data
            start = time.perf_counter()
            first = []

            def on_chunk(chunk):
                if not first and b'"text":"' in chunk:
                    first.append(time.perf_counter())

            try:
                writer.write(request)
                await writer.drain()
                status, payload, closing = await read_response(reader, on_chunk)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                results.append({"ok": False, "error": repr(e)})
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            end = time.perf_counter()
            if closing:  # the server ends this connection after its response
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
            tokens = 0
            if status == 200:
                text = payload.decode("utf-8", "replace")
                usage_at = text.rfind('"completion_tokens":')
                if usage_at >= 0:
                    tokens = int(text[usage_at:].split(":", 1)[1].split(",")[0].split("}")[0])
            results.append({"ok": status == 200, "status": status, "latency": end - start,
                            "ttft": (first[0] - start) if first else None, "tokens": tokens})
    finally:
        writer.close()


async def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--models", default="base")
    p.add_argument("--prompt", default="The function returns")
    p.add_argument("--api-key", default="")
    args = p.parse_args()
    u = urlparse(args.url)
    path = (u.path.rstrip("/") or "") + "/v1/completions"
    jobs = asyncio.Queue()
    for i in range(args.requests):
        jobs.put_nowait(i)
    results = []
    start = time.perf_counter()
    await asyncio.gather(*[worker(args, u.hostname, u.port, path, jobs, results)
                           for _ in range(args.concurrency)])
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    ms = lambda v: None if v is None else round(v * 1000.0, 2)  # noqa: E731
    summary = {
        "requests": len(results), "failed": len(results) - len(ok),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "stream": args.stream,
        "models": args.models.split(","), "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 1),
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "latency_ms": {"mean": ms(statistics.mean(lat)) if lat else None,
                       "p50": ms(percentile(lat, 50)), "p90": ms(percentile(lat, 90)),
                       "p99": ms(percentile(lat, 99)), "max": ms(max(lat) if lat else None)},
    }
    if args.stream:
        summary["ttft_ms"] = {"p50": ms(percentile(ttft, 50)), "p90": ms(percentile(ttft, 90)),
                              "p99": ms(percentile(ttft, 99))}
    print(json.dumps(summary))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

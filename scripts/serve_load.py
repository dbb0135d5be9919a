#!/usr/bin/env python3
"""Load on `loraplex serve`: many concurrent streams, and slow or idle clients.

Two measurements, each on a server this script starts (the tiny Llama fixture and its four
adapters, on the CPU, default flags) or on one given with --url:

  streams  N streamed completions at once (mixed adapters, greedy and seeded sampling, 16 to
           48 tokens); every one must finish and its text and token ids must equal those of
           the same request sent alone, one at a time.
  slow     S connections that send a request's headers one byte every 2 s and I connections
           that send nothing, each reopened whenever the server closes it (as an attacker
           would); while they are open, /health is probed on new connections (latency
           percentiles) and C streamed completions run (all must finish, texts as sent alone).

Prints one JSON object with the numbers; exit status 1 when a stream failed or differed, or
with --health-p99-ms LIMIT when /health's p99 is above it. Raises the open-file limit for its
own sockets.

usage: serve_load.py [--binary build/tools/loraplex] [--testdata testdata] [--url URL]
                     [--streams N] [--slow S] [--idle I] [--completions C] [--health-probes M]
                     [--only streams|slow] [--serve-arg=ARG ...] [--health-p99-ms LIMIT]
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time

FIXTURE_ADAPTERS = ["sql", "pirate", "rslora", "vocab"]
BASE = "tiny"


# ------------------------------------------------------------------------------ plumbing


def raise_fd_limit(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, needed)) if hard != resource.RLIM_INFINITY else max(soft, needed)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class ServerProcess:
    """`loraplex serve` on a free port, its log drained in the background."""

    def __init__(self, binary, testdata, extra):
        fixture = os.path.join(testdata, "tiny-llama")
        args = [binary, "serve", "--model", os.path.join(fixture, "model"), "--port", "0",
                "--served-model-name", BASE, "--device", "cpu"]
        for name in FIXTURE_ADAPTERS:
            args += ["--lora", f"{name}={os.path.join(fixture, 'adapters', name)}"]
        self.proc = subprocess.Popen(args + extra, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log = []
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited at start-up: " + "".join(self.log))
            self.log.append(line)
            m = re.search(r"listening on http://[^ ]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def read_head(reader):
    """Status code and headers (lower-case names) of an HTTP/1.1 response."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed before the status line")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            return status, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def read_body(reader, headers):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return body
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


async def post_stream(host, port, body, timeout=600):
    """One streamed completion on its own connection: (ok, text, token ids, error)."""
    data = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return False, "", [], f"connect: {e!r}"
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: loraplex\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        await writer.drain()
        status, headers = await asyncio.wait_for(read_head(reader), timeout)
        payload = await asyncio.wait_for(read_body(reader, headers), timeout)
    except (OSError, ConnectionError, ValueError, asyncio.TimeoutError,
            asyncio.IncompleteReadError) as e:
        return False, "", [], repr(e)
    finally:
        writer.close()
    if status != 200:
        return False, "", [], f"status {status}: {payload[:300]!r}"
    text, ids, done = "", [], False
    for event in payload.decode("utf-8", "replace").split("\n\n"):
        if not event.startswith("data: "):
            continue
        event = event[len("data: "):]
        if event == "[DONE]":
            done = True
            continue
        j = json.loads(event)
        if "error" in j:
            return False, text, ids, f"error event: {j['error']}"
        for choice in j.get("choices") or []:
            text += choice.get("text") or ""
            ids += choice.get("token_ids") or []
    return done, text, ids, "" if done else "no [DONE]"


def probe_health(host, port, probes):
    """GET /health on a new connection `probes` times, 10 per second: seconds each (None when
    it failed)."""
    out = []
    for _ in range(probes):
        t = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=30) as c:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: loraplex\r\nConnection: close\r\n\r\n")
                got = b""
                while b"\r\n\r\n" not in got:
                    chunk = c.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            out.append(time.perf_counter() - t if got.startswith(b"HTTP/1.1 200") else None)
        except OSError:
            out.append(None)
        time.sleep(0.1)
    return out


def workload(n, models):
    """n distinct streamed completion bodies."""
    prompts = ["The function returns", "Once upon a time", "SELECT name FROM", "Ahoy matey,",
               "The weather today is", "In the beginning", "def main():", "Dear customer,"]
    bodies = []
    for i in range(n):
        body = {"model": models[i % len(models)], "prompt": f"{prompts[i % len(prompts)]} {i}",
                "max_tokens": 16 + i % 33, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        if i % 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            body.update(temperature=0)
        bodies.append(body)
    return bodies


def percentile(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))] if s else None


async def sequential(host, port, bodies):
    return [await post_stream(host, port, b) for b in bodies]


def compare(results, alone):
    failed = [(i, r[3]) for i, r in enumerate(results) if not r[0]]
    differ = [i for i, (r, a) in enumerate(zip(results, alone)) if r[0] and r[1:3] != a[1:3]]
    return failed, differ


# ---------------------------------------------------------------------------- measurements


async def measure_streams(host, port, n, models):
    bodies = workload(n, models)
    t = time.perf_counter()
    alone = await sequential(host, port, bodies)
    sequential_s = time.perf_counter() - t
    t = time.perf_counter()
    results = await asyncio.gather(*(post_stream(host, port, b) for b in bodies))
    concurrent_s = time.perf_counter() - t
    failed, differ = compare(results, alone)
    tokens = sum(len(r[2]) for r in results)
    return {"streams": n, "failed": len(failed), "differ_from_alone": len(differ),
            "baseline_failed": sum(1 for a in alone if not a[0]),
            "first_failures": failed[:5], "first_differences": differ[:5],
            "sequential_s": round(sequential_s, 2), "concurrent_s": round(concurrent_s, 2),
            "output_tokens": tokens,
            "concurrent_tokens_per_s": round(tokens / concurrent_s, 1)}


class Pest:
    """Keeps `count` connections open that each send `payload` one byte every `gap` seconds
    (none: send nothing), reopening every connection the server closes."""

    def __init__(self, host, port, count, payload, gap):
        self.host, self.port, self.count, self.payload, self.gap = host, port, count, payload, gap
        self.open = 0
        self.reopened = 0
        self.tasks = []

    async def one(self):
        first = True
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            if not first:
                self.reopened += 1
            first = False
            self.open += 1
            try:
                k = 0
                while True:
                    if self.payload:
                        writer.write(self.payload[k % len(self.payload):][:1])
                        await writer.drain()
                        k += 1
                    try:
                        got = await asyncio.wait_for(reader.read(4096), self.gap)
                        if not got:
                            break  # the server closed it
                    except asyncio.TimeoutError:
                        pass
            except (OSError, ConnectionError):
                pass
            finally:
                self.open -= 1
                writer.close()

    def start(self):
        self.tasks = [asyncio.ensure_future(self.one()) for _ in range(self.count)]

    async def stop(self):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def measure_slow(host, port, slow, idle, completions, probes, models):
    bodies = workload(completions, models)
    alone = await sequential(host, port, bodies)
    header = (b"POST /v1/completions HTTP/1.1\r\nHost: loraplex\r\n"
              b"Content-Type: application/json\r\n")
    pests = [Pest(host, port, slow, header, 2.0), Pest(host, port, idle, b"", 3600.0)]
    for p in pests:
        p.start()
    deadline = time.time() + 60
    while sum(p.open for p in pests) < slow + idle and time.time() < deadline:
        await asyncio.sleep(0.05)
    opened = sum(p.open for p in pests)
    # Probes at 10 per second, as a load balancer's or kubelet's would come, while completions
    # run concurrently. They run in a process of their own: this event loop, busy reopening
    # hundreds of connections at once, would otherwise add its own delay to their times.
    run = asyncio.ensure_future(asyncio.gather(*(post_stream(host, port, b) for b in bodies)))
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        latencies = await asyncio.get_running_loop().run_in_executor(pool, probe_health, host,
                                                                     port, probes)
    failed_probes = sum(1 for x in latencies if x is None)
    latencies = [x for x in latencies if x is not None]
    results = await run
    open_at_end = sum(p.open for p in pests)
    for p in pests:
        await p.stop()
    failed, differ = compare(results, alone)
    ms = [x * 1000 for x in latencies]
    return {"slow_connections": slow, "idle_connections": idle, "opened": opened,
            "open_at_end": open_at_end,
            "reopened_after_server_close": {"slow": pests[0].reopened, "idle": pests[1].reopened},
            "health_probes": probes, "health_failed": failed_probes,
            "health_ms": {"p50": round(percentile(ms, 50), 2), "p99": round(percentile(ms, 99), 2),
                          "max": round(max(ms), 2)} if ms else None,
            "completions": completions, "completions_failed": len(failed),
            "completions_differ_from_alone": len(differ), "first_failures": failed[:5]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="build/tools/loraplex")
    ap.add_argument("--testdata", default="testdata")
    ap.add_argument("--url", help="http://HOST:PORT of a running server (its models: the base "
                    "model and the fixture's adapters)")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--slow", type=int, default=500)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--completions", type=int, default=50)
    ap.add_argument("--health-probes", type=int, default=200)
    ap.add_argument("--only", choices=["streams", "slow"])
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an argument for `loraplex serve` (repeatable; --serve-arg=--flag)")
    ap.add_argument("--health-p99-ms", type=float, help="fail when /health's p99 exceeds this")
    a = ap.parse_args()
    raise_fd_limit(a.streams + a.slow + a.idle + a.completions + 1024)
    server = None
    if a.url:
        m = re.match(r"^https?://([^:/]+):(\d+)", a.url)
        host, port = m.group(1), int(m.group(2))
    else:
        server = ServerProcess(a.binary, a.testdata, a.serve_arg)
        host, port = "127.0.0.1", server.port
    models = [BASE] + FIXTURE_ADAPTERS
    out = {"server": a.url or "loraplex serve (tiny-llama, CPU) " + " ".join(a.serve_arg)}
    try:
        loop = asyncio.new_event_loop()
        if a.only in (None, "streams"):
            out["streams"] = loop.run_until_complete(measure_streams(host, port, a.streams,
                                                                     models))
        if a.only in (None, "slow"):
            out["slow"] = loop.run_until_complete(
                measure_slow(host, port, a.slow, a.idle, a.completions, a.health_probes, models))
    finally:
        if server:
            server.stop()
    print(json.dumps(out, indent=2))
    bad = False
    if "streams" in out:
        s = out["streams"]
        bad |= s["failed"] > 0 or s["differ_from_alone"] > 0 or s["baseline_failed"] > 0
    if "slow" in out:
        s = out["slow"]
        bad |= s["completions_failed"] > 0 or s["completions_differ_from_alone"] > 0
        bad |= s["health_failed"] > 0
        if a.health_p99_ms is not None and s["health_ms"]:
            bad |= s["health_ms"]["p99"] > a.health_p99_ms
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

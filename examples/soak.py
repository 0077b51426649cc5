"""Soak a running deepinfer server: mixed streaming / non-streaming completions and chat requests,
random mid-stream disconnects and malformed requests, for a bounded time and request count.

    python examples/soak.py --base-url http://127.0.0.1:8000 --duration 600 --concurrency 32 --json out.json

Reports requests ok / failed by cause, latency percentiles of the completed requests, the server's
RSS at the start and the end (from /proc/<pid>/status: --server-pid, or the process listening on the
port), and the KV blocks still in use once the traffic drained (`deepinfer:kv_blocks_used` on
/metrics; anything but 0 is a leak). Only loopback servers are accepted.

--shared-prefix-len N: half of the completions send token-id prompts made of one of
--num-shared-prefixes fixed prefixes of N tokens and a random suffix, so the server's prefix cache is
exercised (hit and miss, blocks shared by concurrent requests, eviction once the pool fills); the
report adds the prefix-cache hit rate over the run (`deepinfer:prefix_cache_hits` / `_queries`) and
the free KV blocks after the drain (cached blocks nobody holds count as free).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
KV_METRIC = "deepinfer:kv_blocks_used"
KV_FREE_METRIC = "deepinfer:kv_blocks_free"
HITS_METRIC, QUERIES_METRIC = "deepinfer:prefix_cache_hits_total", "deepinfer:prefix_cache_queries_total"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,", "Hello"]
MALFORMED = [  # (body bytes or JSON, the status a correct server answers)
    (b'{"prompt": "hi", ', 400), ({"prompt": "hi", "max_tokens": "3"}, 400),
    ({"prompt": "hi", "temperature": 9}, 400), ({"prompt": [], "max_tokens": 2}, 400),
    ({"prompt": "hi", "n": 0}, 400), ({"prompt": [10 ** 9]}, 400), ({"max_tokens": 2}, 400),
    ({"prompt": "hi", "max_tokens": 0}, 400), ({"prompt": "hi", "logprobs": 99}, 400),
]


# ---- the server process ------------------------------------------------------------------------
def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pid_listening_on(port: int) -> int | None:
    """The process owning a listening TCP socket on `port` (from /proc/net/tcp* and /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = str(fd.readlink())
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            return float(line.rsplit(" ", 1)[1])
    return None


# ---- traffic -----------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.ok = 0
        self.failed: dict[str, int] = {}
        self.latencies: list[float] = []
        self.disconnects = 0
        self.malformed_ok = 0

    def fail(self, cause: str) -> None:
        self.failed[cause] = self.failed.get(cause, 0) + 1


def shared_prefixes(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 50_000) for _ in range(length)] for _ in range(count)]


def _completion_body(rng: random.Random, stream: bool, prefixes: list[list[int]]) -> tuple[str, dict]:
    if prefixes and rng.random() < 0.5:
        suffix = [rng.randint(100, 50_000) for _ in range(rng.randint(1, 16))]
        body = {"prompt": rng.choice(prefixes) + suffix, "max_tokens": rng.randint(1, 16)}
        path = "/v1/completions"
    elif rng.random() < 0.3:
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(1, 16)}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 16)}
        if rng.random() < 0.2:
            body.update(echo=True, logprobs=2, max_tokens=rng.choice([0, 2]))
        path = "/v1/completions"
    body.update(temperature=rng.choice([0.0, 0.7, 1.0]), stream=stream)
    return path, body


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      prefixes: list[list[int]]) -> None:
    kind = rng.random()
    t0 = time.perf_counter()
    try:
        if kind < 0.1:  # malformed: must be refused with its documented status, never a 5xx
            body, want = rng.choice(MALFORMED)
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post("/v1/completions", **kw)
            if r.status_code == want:
                tally.malformed_ok += 1
            else:
                tally.fail(f"malformed got {r.status_code}")
            return
        stream = kind < 0.6
        path, body = _completion_body(rng, stream, prefixes)
        if not stream:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                tally.fail(f"http {r.status_code}")
                return
            if not r.json().get("choices"):
                tally.fail("no choices")
                return
        else:
            disconnect_after = rng.randint(1, 4) if rng.random() < 0.25 else None
            events, done = 0, False
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    tally.fail(f"http {r.status_code}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if '"error"' in line:
                        tally.fail("stream error event")
                        return
                    events += 1
                    if disconnect_after is not None and events >= disconnect_after:
                        tally.disconnects += 1  # leaving the block closes the connection
                        return
            if not done:
                tally.fail("stream without [DONE]")
                return
        tally.ok += 1
        tally.latencies.append(time.perf_counter() - t0)
    except httpx.TimeoutException:
        tally.fail("timeout")
    except httpx.HTTPError as e:
        tally.fail(type(e).__name__)


async def worker(client, rng, tally, deadline: float, budget: list[int], prefixes) -> None:
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        await one_request(client, rng, tally, prefixes)


async def _metrics(client) -> str:
    try:
        return (await client.get("/metrics")).text
    except httpx.HTTPError:
        return ""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def soak(args) -> dict:
    url = urlparse(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pid = args.server_pid or pid_listening_on(url.port or 80)
    tally = Tally()
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        rss_start = rss_kib(pid) if pid else None
        prefixes = shared_prefixes(args.shared_prefix_len, args.num_shared_prefixes, args.seed) \
            if args.shared_prefix_len else []
        page = await _metrics(client)
        hits0, queries0 = metric(page, HITS_METRIC), metric(page, QUERIES_METRIC)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        budget = [args.max_requests]
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
        await asyncio.gather(*(worker(client, rng, tally, deadline, budget, prefixes) for rng in rngs))
        elapsed = time.monotonic() - t0
        # drain: aborted streams free their blocks within a step or two
        kv_used, drain_deadline = None, time.monotonic() + args.drain_timeout
        while True:
            page = await _metrics(client)
            kv_used = metric(page, KV_METRIC)
            if kv_used == 0 or time.monotonic() > drain_deadline:
                break
            await asyncio.sleep(0.2)
        kv_free = metric(page, KV_FREE_METRIC)
        hits, queries = metric(page, HITS_METRIC), metric(page, QUERIES_METRIC)
        rss_end = rss_kib(pid) if pid else None
    lat = tally.latencies
    return {
        "base_url": args.base_url, "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
        "requests_ok": tally.ok, "requests_failed": sum(tally.failed.values()),
        "failed_by_cause": tally.failed, "disconnects": tally.disconnects,
        "malformed_refused_correctly": tally.malformed_ok,
        "latency_s": {f"p{q}": percentile(lat, q) for q in (50, 90, 99)} | {"max": max(lat, default=None)},
        "requests_per_s": round((tally.ok + tally.disconnects) / elapsed, 2) if elapsed else None,
        "server_pid": pid, "server_rss_kib_start": rss_start, "server_rss_kib_end": rss_end,
        "kv_blocks_used_after_drain": kv_used, "kv_blocks_free_after_drain": kv_free,
        "shared_prefix_len": args.shared_prefix_len,
        "prefix_cache": _hit_rate(hits0, queries0, hits, queries),
    }


def _hit_rate(hits0, queries0, hits, queries) -> dict | None:
    """Prompt tokens looked up / found in the prefix cache during the run (None: no such metrics)."""
    if None in (hits0, queries0, hits, queries):
        return None
    h, q = hits - hits0, queries - queries0
    return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="a loopback server, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, required=True, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--server-pid", type=int, help="server process for RSS (default: owner of the port)")
    p.add_argument("--api-key")
    p.add_argument("--max-requests", type=int, default=100_000, help="upper bound on requests sent")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of the shared prefixes half the completions start with (0: none)")
    p.add_argument("--num-shared-prefixes", type=int, default=4)
    args = p.parse_args(argv)
    if args.shared_prefix_len < 0 or args.num_shared_prefixes < 1:
        p.error("--shared-prefix-len must be >= 0 and --num-shared-prefixes >= 1")
    if urlparse(args.base_url).hostname not in LOOPBACK:
        p.error("--base-url must be a loopback address (127.0.0.1 / localhost)")
    if not 0 < args.duration <= 24 * 3600 or not 1 <= args.concurrency <= 1024:
        p.error("--duration must be in (0, 86400] s and --concurrency in [1, 1024]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    clean = report["requests_failed"] == 0 and report["kv_blocks_used_after_drain"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

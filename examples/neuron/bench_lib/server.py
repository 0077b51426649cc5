"""Server driver: streaming /v1/completions against a running server, like
`vllm bench serve --backend openai --max-concurrency C --ignore-eos`.

One closed loop per cell: every request waits on a semaphore of `concurrency` slots, so exactly
that many are in flight until the prompts run out. A request counts as successful only when the
server answered 200 and the stream was well formed: JSON `data:` events, no error event, a usage
chunk (stream_options.include_usage), and a final `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench_lib.metrics import RequestResult


class ServerDriver:
    def __init__(self, base_url: str, model_name: str | None, api_key: str | None, timeout_s: float,
                 temperature: float, seed: int):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.temperature = temperature
        self.seed = seed
        self.probe_errors: list[str] = []
        self.health = self._probe_health()
        self.model_name = model_name or self._served_model()

    def _get(self, path: str) -> httpx.Response:
        # trust_env=False: a proxy from the environment must not sit between us and the server.
        return httpx.get(self.base_url + path, headers=self.headers, timeout=10.0, trust_env=False)

    def _probe_health(self) -> int | None:
        try:
            return self._get("/health").status_code
        except httpx.HTTPError as e:
            self.probe_errors.append(f"GET /health: {type(e).__name__}: {e}")
            return None

    def _served_model(self) -> str | None:
        try:
            resp = self._get("/v1/models")
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            self.probe_errors.append(f"GET /v1/models: {type(e).__name__}: {e}")
            return None

    @property
    def num_graphs(self) -> int | None:
        """The server's deepinfer:graphs_compiled_total, None where /metrics does not answer."""
        try:
            resp = self._get("/metrics")
            resp.raise_for_status()
        except httpx.HTTPError as e:
            self.probe_errors.append(f"GET /metrics: {type(e).__name__}: {e}")
            return None
        for line in resp.text.splitlines():
            if line.startswith("deepinfer:graphs_compiled_total"):
                return int(float(line.rpartition(" ")[2]))
        return None

    def info(self) -> dict:
        return {"base_url": self.base_url, "served_model": self.model_name, "health_status": self.health,
                "probe_errors": list(self.probe_errors)}

    def run(self, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[RequestResult], float]:
        return asyncio.run(self._run(prompts, output_len, concurrency))

    async def _run(self, prompts, output_len, concurrency):
        results = [RequestResult(len(p), output_len) for p in prompts]
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        slots = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits, trust_env=False) as client:
            async def limited(prompt, result):
                async with slots:
                    await self._one(client, self._payload(prompt, output_len), result)
            t0 = time.perf_counter()
            await asyncio.gather(*(limited(p, r) for p, r in zip(prompts, results)))
            return results, time.perf_counter() - t0

    def _payload(self, prompt: list[int], output_len: int) -> dict:
        return {"model": self.model_name, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
                "ignore_eos": True, "temperature": self.temperature, "seed": self.seed, "stream": True,
                "stream_options": {"include_usage": True}}

    async def _one(self, client: httpx.AsyncClient, payload: dict, r: RequestResult) -> None:
        r.start = time.perf_counter()
        try:
            async with client.stream("POST", self.base_url + "/v1/completions", json=payload,
                                     headers=self.headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    r.fail(f"HTTP {resp.status_code}: {body[:300]}")
                    return
                await self._read_stream(resp, r)
        except httpx.HTTPError as e:
            r.fail(f"{type(e).__name__}: {e}")
        finally:
            r.end = time.perf_counter()

    @staticmethod
    async def _read_stream(resp: httpx.Response, r: RequestResult) -> None:
        buf, done, usage = "", False, None
        async for text in resp.aiter_text():
            now = time.perf_counter()
            buf += text.replace("\r\n", "\n")
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                for line in event.split("\n"):
                    if not line or line.startswith(":"):
                        continue  # blank, or an SSE comment (keep-alive ping)
                    if not line.startswith("data:"):
                        r.fail(f"malformed stream: not an SSE data line: {line[:100]!r}")
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    if done:
                        r.fail("malformed stream: an event after [DONE]")
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        r.fail(f"malformed stream: invalid JSON {data[:100]!r}")
                        continue
                    if not isinstance(obj, dict):
                        r.fail(f"malformed stream: event is not an object: {data[:100]!r}")
                        continue
                    if obj.get("error"):
                        err = obj["error"]
                        r.fail(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
                    if obj.get("choices"):
                        r.token_times.append(now)  # vLLM: every non-empty choices chunk, even empty text
                    if obj.get("usage"):
                        usage = obj["usage"]
        if buf.strip():
            r.fail(f"malformed stream: unterminated event {buf.strip()[:100]!r}")
        if not done:
            r.fail("malformed stream: it ended without data: [DONE]")
        if usage is None:
            r.fail("no usage chunk (stream_options.include_usage) in the stream")
        else:
            try:
                r.output_len = int(usage["completion_tokens"])
            except (KeyError, TypeError, ValueError):
                r.fail(f"malformed usage chunk: {usage!r}")

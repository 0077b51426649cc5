"""Helpers for the server tests: a real `python -m deepinfer.serve` process on a free
loopback port, SSE parsing and /metrics reading."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO

API_KEY = "test-key-123"
MODEL_NAME = "tiny-v4"
# Small enough that the tests' prompts + max_tokens fit, big enough for a 200-token request.
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 32
NUM_KV_BLOCKS = 512


def model_dir_fixture(request, tmp_path_factory) -> Path:
    """The session's tiny V4 checkpoint (conftest's tiny_v4_dir), or one made here."""
    try:
        return Path(request.getfixturevalue("tiny_v4_dir"))
    except pytest.FixtureLookupError:
        from deepinfer.model_executor.tiny_checkpoint import make_tiny_checkpoint
        return Path(make_tiny_checkpoint("v4", tmp_path_factory.mktemp("tiny_v4"), seed=0))


def engine_args() -> dict:
    """The engine settings the server runs with (the offline reference uses the same). fp32: in bf16
    a row's logits move (~0.1) with the batch it shares a GEMM with, so a server batch and an offline
    batch of the same prompts can break a near-tie differently (tests compare their tokens)."""
    return dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=NUM_KV_BLOCKS,
                dtype="float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, *extra: str, api_key: str | None = API_KEY):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "deepinfer.serve", "--model", str(model_dir), "--port", str(self.port),
               "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", str(NUM_KV_BLOCKS),
               "--dtype", engine_args()["dtype"], "--log-level", "warning", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.health_statuses: list[int] = []  # what /health answered while starting

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                status = httpx.get(self.base + "/health", timeout=2.0).status_code
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            self.health_statuses.append(status)
            if status == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def child_pids(self) -> list[int]:
        """Direct children of the server process (from /proc)."""
        pids = []
        task_dir = Path(f"/proc/{self.proc.pid}/task")
        for task in task_dir.iterdir() if task_dir.exists() else []:
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return pids

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        return metric_values(httpx.get(self.base + "/metrics", timeout=10.0).text)

    def wait_metrics(self, predicate, timeout_s: float = 30.0) -> dict[str, float]:
        """Poll /metrics until predicate(metrics) holds; returns those metrics."""
        deadline = time.monotonic() + timeout_s
        m = self.metrics()
        while not predicate(m):
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics condition not met within {timeout_s} s: {m}")
            time.sleep(0.05)
            m = self.metrics()
        return m


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str):
    """A ready ServerProcess, terminated on the way out (a module fixture's body)."""
    srv = ServerProcess(model_dir, *extra)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def metric_values(text: str) -> dict[str, float]:
    """{'sample{labels}': value} of a /metrics page, parsed by prometheus_client. The model_name
    label (the same on every sample) is left out; the others (finish reason, bucket bound) stay."""
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k != "model_name")
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def parse_sse(raw: str) -> tuple[list[dict], bool]:
    """(JSON events, whether the stream ended with [DONE]) of an SSE body."""
    events, done = [], False
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block[:100]!r}"
        data = block[len("data: "):]
        assert not done, "event after [DONE]"
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def stream_text(events: list[dict]) -> dict[int, str]:
    """Concatenated text per choice index of completion chunks."""
    texts: dict[int, str] = {}
    for ev in events:
        for ch in ev.get("choices", []):
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    return texts


@contextlib.asynccontextmanager
async def in_process_app(engine_config, served_model_name: str = "m", timeout: float = 300):
    """The real app and engine loop in this process, over httpx's ASGI transport: yields
    (client, state) once the engine is ready, and stops the engine loop afterwards."""
    import asyncio

    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.serve.app import build_app
    from deepinfer.serve.engine_loop import EngineLoop
    from deepinfer.serve.metrics import ServerMetrics
    from deepinfer.serve.state import ServerConfig, ServerState

    state = ServerState(ServerConfig(served_model_name=served_model_name),
                        EngineLoop(lambda: LLMEngine(engine_config), ServerMetrics()))
    state.engine_loop.start(asyncio.get_running_loop())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)),
                                     base_url="http://t", timeout=timeout) as client:
            for _ in range(1200):
                if state.engine_loop.ready:
                    break
                await asyncio.sleep(0.05)
            yield client, state
    finally:
        state.engine_loop.stop()

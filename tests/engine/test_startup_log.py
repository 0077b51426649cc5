"""The startup log of LLM(...) (deepinfer/worker/startup_log.py) and the per-step DEBUG line,
through DEEPINFER_LOG_LEVEL in a fresh interpreter (the level is applied at import) with no logging
configured by the script, as a user's script runs it. The server's startup lines:
tests/process/test_server.py::test_startup_is_logged_at_info."""
import os
import re
import subprocess
import sys

from tests.support import REPO as ROOT

# Starts at DEEPINFER_LOG_LEVEL=DEBUG, then sets ERROR the same way (the variable, read again by
# configure_logging()) and generates once more: one model load covers both levels.
SCRIPT = """
import os, sys
from deepinfer import LLM, SamplingParams
from deepinfer.logging_config import configure_logging
llm = LLM(model=sys.argv[1], max_model_len=128, max_num_seqs=3, enforce_eager=True)
out = llm.generate(["Hello", "abc"], SamplingParams(max_tokens=2), use_tqdm=False)
w = llm.llm_engine.worker
print("POOL", w.num_kv_blocks, w.block_size, w.bytes_per_block, len(out))
os.environ["DEEPINFER_LOG_LEVEL"] = "ERROR"
configure_logging()
print("--- ERROR from here ---", file=sys.stderr, flush=True)
out = llm.generate(["Hello", "abc"], SamplingParams(max_tokens=2), use_tqdm=False)
print("AGAIN", len(out))
"""
LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR) (deepinfer[\w.]*): (.*)$")


def _records(stderr: str) -> list[tuple[str, str, str]]:
    return [m.groups() for m in map(LINE.match, stderr.splitlines()) if m]


def test_debug_shows_the_startup_lines_and_each_step_and_error_shows_none(tiny_v4_dir):
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_LOG_LEVEL"}
    env.update(DEEPINFER_LOG_LEVEL="DEBUG", PYTHONPATH=str(ROOT), DEEPINFER_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_v4_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "AGAIN 2" in out.stdout
    stdout = out.stdout
    at_debug, at_error = out.stderr.split("--- ERROR from here ---\n")
    debug, error = _records(at_debug), _records(at_error)
    assert error == []          # nothing went wrong, so nothing at ERROR
    assert len(debug) > len(error)
    info = [msg for level, _, msg in debug if level == "INFO"]
    config = next(m for m in info if m.startswith("engine config:"))
    assert f"model={tiny_v4_dir}" in config and "platform=cpu" in config and "parallel=(cp=1 ep=1" in config
    assert "speculative=off" in config and "weight_format=dense" in config
    weights = next(m for m in info if m.startswith("weights loaded:"))
    assert re.search(r"\d+\.\d+ (MiB|GiB) \(dense\) from .* in \d+\.\d+ s$", weights), weights
    assert any(m == "runner: eager" for m in info)
    # the KV pool line, at INFO, carries the worker's own numbers
    blocks, block_size, per_block, n = map(int, stdout.split("POOL", 1)[1].split()[:4])
    assert n == 2
    kv = next(m for m in info if m.startswith("KV cache:"))
    assert kv.startswith(f"KV cache: {blocks} blocks of {block_size} tokens, ")
    assert f"{per_block} B per block" in kv
    concurrency = (blocks - 1) / -(-128 // block_size)
    assert f"max concurrency at max_model_len 128: {concurrency:.2f}x (max_num_seqs 3)" in kv
    steps = [msg for level, name, msg in debug
             if level == "DEBUG" and name == "deepinfer.engine.llm_engine" and msg.startswith("step: ")]
    assert steps
    # one prefill step of both prompts, then decode steps of both rows
    assert re.match(r"step: 2 rows, \d+ prefill \+ 0 decode tokens, 2 sampled", steps[0]), steps[0]
    assert any(re.match(r"step: 2 rows, 0 prefill \+ 2 decode tokens, 2 sampled", s) for s in steps[1:]), steps


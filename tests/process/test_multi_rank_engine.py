"""One model across ranks (docs/architecture.md §8): real follower processes, a gloo process group and
the /dev/shm step ring, driven through LLM.generate, `deepinfer follow`, the server and the bench.

Every configuration must give the single-rank tokens, greedy and seeded, for prompts of different
lengths in one batch. Each rank holds its slices of the model (build_model(parallel=...)), so every
step needs every rank: the lanes all-reduce attention, the EP groups exchange tokens; data-parallel
groups hold their sequences' KV alone, so a wrong slot, order or padding changes the tokens, and the
driver must get every group's logits back in chunk order. fp32: in bf16 the logits of one row change
(~0.1) with the batch it shares a GEMM with, even on one rank.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.distributed.launch import free_port
from tests.support import load_script
from tests.support.processes import alive, child_env

bench_neuron = load_script("examples/neuron/bench_neuron.py")

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=40,
              enforce_eager=True, skip_tokenizer_init=True, dtype="float32")
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 7, 12)]
PARAMS = [SamplingParams(max_tokens=5, temperature=0.0),
          SamplingParams(max_tokens=5, temperature=0.8, seed=3),
          SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)]
CONFIGS = {
    "cp2": dict(context_parallel_size=2),
    "cp4-lanes2": dict(context_parallel_size=4, attention_tp_size=2),
    "ep2": dict(expert_parallel_size=2),
    "ep4": dict(expert_parallel_size=4),
    "cp2-ep2": dict(context_parallel_size=2, expert_parallel_size=2),
}


def _run(llm: LLM):
    """Each prompt's tokens, and the third one's prompt logprobs ({token: logprob} per position): scored
    rows come back from the ranks in chunk order like the sampled ones."""
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    scored = [{t: lp.logprob for t, lp in pos.items()} for pos in outs[2].prompt_logprobs[1:]]
    return [list(o.outputs[0].token_ids) for o in outs], scored


def _tokens(llm: LLM) -> list[list[int]]:
    return _run(llm)[0]


@pytest.fixture(scope="module")
def references(tiny_v4_dir, tiny_v41_dir):
    out = {}
    for kind, path in (("v4", tiny_v4_dir), ("v41", tiny_v41_dir)):
        with LLM(str(path), **ENGINE) as llm:
            out[kind] = (str(path), *_run(llm))
    return out


# `make test` runs cp = ep = 2 on V4.1 (the target model); cp2 and ep2 alone on V4.1 also run there in
# tests/process/test_multi_rank_spec.py (the same main forward, plus the draft blocks). The other worlds
# are left to `make test-all` (tests/support/slow_tests.py).
CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for kind in ("v4", "v41") for name in CONFIGS]


@pytest.mark.parametrize("name, kind", CASES)
def test_tokens_equal_single_rank(references, kind, name):
    path, expected, expected_scores = references[kind]
    with LLM(path, **ENGINE, **CONFIGS[name]) as llm:
        worker = llm.llm_engine.worker
        layout = worker.parallel.layout
        assert layout.world_size == max(layout.cp, layout.ep) == len(llm.llm_engine.executor.ranks.pids) + 1
        pids = list(llm.llm_engine.executor.ranks.pids.values())
        assert all(alive(p) for p in pids)
        tokens, scores = _run(llm)
        assert tokens == expected
        assert [sorted(s) for s in scores] == [sorted(s) for s in expected_scores]
        for got, want in zip(scores, expected_scores):
            assert all(abs(got[t] - want[t]) < 1e-4 for t in want)
        assert worker.runner.transport.steps_published >= 5
    assert not any(alive(p) for p in pids), "close() left a follower running"


def _follow_cmd(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer.cli", "follow", "--model", model, "--nnodes", "2",
            "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]


def test_two_nodes_on_localhost(references):
    """Two "hosts": this process is node 0 (driver + one spawned rank), `deepinfer follow` is node 1
    (its first rank + one it spawns). ep=4 over cp=1: four data-parallel groups, two per host, so the
    step goes over the host broadcast and both hosts' rings, and the logits come back across hosts."""
    path, expected, _ = references["v41"]
    port = free_port()
    node1 = subprocess.Popen(_follow_cmd(path, port, "--expert-parallel-size", "4"), env=child_env())
    try:
        with LLM(path, **ENGINE, expert_parallel_size=4, nnodes=2, master_port=port) as llm:
            layout = llm.llm_engine.worker.parallel.layout
            assert (layout.nnodes, layout.ranks_per_node, layout.dp) == (2, 2, 4)
            assert _tokens(llm) == expected
        assert node1.wait(30) == 0   # the stop message reached host 1 and it exited cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_server_and_bench_with_cp2_ep2(references, tmp_path):
    """--context-parallel-size / --expert-parallel-size through `python -m deepinfer.serve`: the completions
    equal the single-rank tokens, bench_neuron.py runs against it, and SIGTERM leaves no child."""
    from tests.support.server import MODEL_NAME, ServerProcess
    path, expected, _ = references["v4"]
    srv = ServerProcess(Path(path), "--context-parallel-size", "2", "--expert-parallel-size", "2",
                        "--dtype", "float32", "--enforce-eager", api_key=None)
    try:
        srv.wait_ready()
        children = srv.child_pids()
        assert len(children) == 1, children   # world 2: one follower
        for prompt, params, want in zip(PROMPTS, PARAMS, expected):
            body = {"model": MODEL_NAME, "prompt": prompt["prompt_token_ids"], "max_tokens": 5,
                    "temperature": params.temperature}
            if params.seed is not None:
                body["seed"] = params.seed
            r = httpx.post(srv.base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == len(want)
            assert r.json()["choices"][0]["text"] == _decode(path, want)
        out = tmp_path / "bench.json"
        assert bench_neuron.main(["--model", path, "--input-lens", "6", "--output-lens", "3", "--concurrency", "2",
                                  "--num-prompts", "2", "--num-warmups", "0", "--base-url", srv.base,
                                  "--cp", "2", "--ep", "2", "--out", str(out)]) == 0
        rec = json.loads(out.read_text())["records"][0]
        assert (rec["completed"], rec["failed"]) == (2, 0)
        assert rec["platform"]["layout"]["cp"] == 2 and rec["platform"]["layout"]["ep"] == 2
    finally:
        code = srv.terminate()
    assert code == 0, srv.read_log()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in children), "the server left a follower behind"


def _decode(path: str, ids: list[int]) -> str:
    from deepinfer.tokenizer import load_tokenizer
    return load_tokenizer(path).decode(ids)


def test_bench_offline_records_the_layout(tiny_v41_dir, tmp_path):
    """--cp 2 --ep 2 --nextn 3: speculative decoding over ranks through the bench."""
    out = tmp_path / "bench.json"
    assert bench_neuron.main(["--model", str(tiny_v41_dir), "--input-lens", "6", "--output-lens", "4",
                              "--concurrency", "2", "--num-prompts", "2", "--num-warmups", "0", "--enforce-eager",
                              "--cp", "2", "--ep", "2", "--nextn", "3", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["records"][0]
    assert (rec["completed"], rec["failed"]) == (2, 0)
    assert rec["nextn"] == 3 and rec["spec_decode"]["draft_tokens"] > 0
    assert rec["platform"]["layout"] == {"world_size": 2, "cp": 2, "ep": 2, "attention_tp_size": 2, "dp": 1,
                                         "nnodes": 1}
    assert rec["config"]["engine"]["context_parallel_size"] == 2

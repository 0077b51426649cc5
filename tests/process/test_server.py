"""The OpenAI-compatible server as a real uvicorn process over the tiny V4 checkpoint.

One server per module; the offline reference is LLM.generate with the same engine settings.
Every request is greedy with small max_tokens: the tiny model decodes a few tokens a second on 2
cores, so the 32-client and disconnect tests take seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.chat_template import ChatTurn, render_chat
from tests.support.server import (API_KEY, MAX_MODEL_LEN, MODEL_NAME, NUM_KV_BLOCKS, ServerProcess, engine_args,
                                 model_dir_fixture, parse_sse, stream_text)


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return model_dir_fixture(request, tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(model_dir, "--max-body-bytes", str(1 << 20), "--log-level", "info")  # the last one wins
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def llm(model_dir, server):  # after the server, so its startup overlaps nothing else
    from deepinfer.entrypoints.llm import LLM
    return LLM(str(model_dir), **engine_args())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def offline_texts(llm, prompts, max_tokens: list[int], **kw) -> list[str]:
    outs = llm.generate(prompts, [greedy(m, **kw) for m in max_tokens], use_tqdm=False)
    return [o.outputs[0].text for o in outs]


C, CHAT = "/v1/completions", "/v1/chat/completions"


def post(server, path: str, body, headers=None, timeout=120.0) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    auth = server.headers if headers is None else headers
    return httpx.post(server.base + path, content=data, timeout=timeout,
                      headers={"Content-Type": "application/json", **auth})


# ---- basics -------------------------------------------------------------------------------------
def test_health_was_503_while_loading_then_200(server):
    # The server binds before the engine thread has loaded the model, so the first answer seen
    # while polling is a 503; it then turns 200.
    assert server.health_statuses[0] == 503
    assert server.health_statuses[-1] == 200
    assert httpx.get(server.base + "/health").status_code == 200


def test_startup_is_logged_at_info(server, model_dir):
    # the whole log: read_log keeps only its tail
    log = Path(server.log.name).read_text(errors="replace")
    assert f"INFO deepinfer.worker.startup_log: engine config: model={model_dir} platform=" in log
    assert f"INFO deepinfer.worker.startup_log: KV cache: {NUM_KV_BLOCKS} blocks of " in log
    assert "INFO deepinfer.worker.startup_log: weights loaded: " in log
    assert f"INFO deepinfer.serve.cli: serving {model_dir} as '{MODEL_NAME}' on http://127.0.0.1:{server.port}" in log


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_metrics_prometheus_format(server):
    r = httpx.get(server.base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                       ("kv_blocks_used", "gauge"), ("kv_blocks_free", "gauge"),
                       ("prompt_tokens_total", "counter"), ("generation_tokens_total", "counter"),
                       ("graphs_compiled_total", "counter"),
                       ("time_to_first_token_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram")]:
        assert f"# TYPE deepinfer:{name} {kind}" in text
    m = server.metrics()
    assert m["deepinfer:kv_blocks_used"] == 0
    assert m["deepinfer:kv_blocks_free"] > 0
    assert m["deepinfer:graphs_compiled_total"] == 0   # the CPU platform's eager runner


# ---- parity with LLM.generate -------------------------------------------------------------------
PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def in_parallel(*calls):
    """Run the calls on threads (so the server batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_openai_client_completions_match_offline(client, llm):
    expected = offline_texts(llm, PARITY_PROMPTS, [4] * 3)

    def stream(prompt):
        return list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    got, *streams = in_parallel(
        lambda: client.completions.create(model=MODEL_NAME, prompt=PARITY_PROMPTS, max_tokens=4,
                                          temperature=0),
        *[lambda p=p: stream(p) for p in PARITY_PROMPTS])
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == expected
    assert [c.finish_reason for c in got.choices] == ["length"] * 3
    assert got.usage.completion_tokens == 12
    prompt_lens = [len(llm.get_tokenizer().encode(p)) for p in PARITY_PROMPTS]
    assert got.usage.prompt_tokens == sum(prompt_lens)
    for chunks, text in zip(streams, expected):
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        finals = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])


def test_token_id_prompts_and_echo_match_offline(server, llm):
    ids = [[5, 17, 400, 1234], [9, 9, 9]]
    expected = offline_texts(llm, [{"prompt_token_ids": p} for p in ids], [3, 3])
    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 3,
                                         "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    tok = llm.get_tokenizer()
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [tok.decode(p) + e for p, e in zip(ids, expected)]
    assert r.json()["usage"]["prompt_tokens"] == 7


def test_n_seed_and_logprobs(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 1.0, "n": 2,
            "seed": 7, "logprobs": 2}
    first, again = in_parallel(*[lambda: post(server, "/v1/completions", body).json()] * 2)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    for c in first["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2
        assert all(v <= 0.0 for v in lp["token_logprobs"])
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
        assert "".join(lp["tokens"]) == c["text"]


def _teacher_forced(llm, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]), p >= 1, from the engine's own model fed the whole prompt at once."""
    from tests.support.model_helpers import run_chunks
    worker = llm.llm_engine.worker
    logits = run_chunks(worker.model, ids, [len(ids)], dtype=worker.dtype)
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo_logprobs_score_the_prompt_like_lm_eval(client, server, llm):
    """lm-evaluation-harness local-completions loglikelihood: echo, logprobs, max_tokens 0."""
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog"
    ids = list(tok.encode(text))
    for prompt in (ids, text):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=2,
                                        max_tokens=0, temperature=0)
        c = got.choices[0]
        assert c.text == (text if prompt is text else tok.decode(ids)) and c.finish_reason == "length"
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], _teacher_forced(llm, ids))) < 1e-4
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: one chunk with the scored prompt; with generation: prompt part, then the tokens
    events, done = parse_sse(post(server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0,
        "stream": True}).text)
    assert done and len(events) == 1
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][1:] == lp.token_logprobs[1:]
    both = client.completions.create(model=MODEL_NAME, prompt=ids, echo=True, logprobs=1,
                                     max_tokens=3, temperature=0)
    blp = both.choices[0].logprobs
    assert len(blp.tokens) == len(ids) + 3 and blp.token_logprobs[:len(ids)][1:] == lp.token_logprobs[1:]
    assert "".join(blp.tokens[len(ids):]) == both.choices[0].text[len(tok.decode(ids)):]


def test_stop_string_and_stop_token_ids(server, llm):
    ref = llm.generate(["Once upon a time"], greedy(6), use_tqdm=False)[0].outputs[0]
    full, ids = ref.text, ref.token_ids
    stop = full[len(full) // 2:][:2]
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    by_id, by_str = in_parallel(
        lambda: post(server, C, {**body, "stop_token_ids": [ids[2]]}).json(),
        lambda: post(server, C, {**body, "stop": [stop]}).json())
    assert by_id["choices"][0]["finish_reason"] == "stop"
    assert by_id["choices"][0]["stop_reason"] == ids[2]
    assert by_id["usage"]["completion_tokens"] == 3
    assert by_str["choices"][0]["text"] == full[:full.index(stop)]
    assert by_str["choices"][0]["finish_reason"] == "stop"
    assert by_str["choices"][0]["stop_reason"] == stop


def test_chat_uses_deepseek_template(client, llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    text = render_chat([ChatTurn(m["role"], m["content"]) for m in messages])
    ids = llm.get_tokenizer().encode(text)
    assert ids.count(0) == 1, "exactly one BOS"
    expected = offline_texts(llm, [{"prompt_token_ids": ids}], [4])[0]
    got, chunks = in_parallel(
        lambda: client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                               temperature=0),
        lambda: list(client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                    max_tokens=4, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})))
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected
    assert got.usage.prompt_tokens == len(ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 4


# ---- concurrency --------------------------------------------------------------------------------
PENALTIES = dict(logit_bias={"4911": 12.0}, frequency_penalty=1.5, presence_penalty=0.5)
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                "ok": {"type": "boolean"}},
               "required": ["answer", "ok"], "additionalProperties": False}


def test_openai_client_penalties_logit_bias_n_and_best_of(client, llm):
    prompt = "Once upon a time"
    offline = llm.generate([prompt], greedy(6, logit_bias={4911: 12.0}, frequency_penalty=1.5,
                                            presence_penalty=0.5, repetition_penalty=1.1),
                           use_tqdm=False)[0].outputs[0]
    ref = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=4, logprobs=0),
                       use_tqdm=False)[0].outputs
    best = sorted(ref, key=lambda c: (-c.cumulative_logprob, c.index))[:2]
    penalised = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"repetition_penalty": 1.1}, **PENALTIES)
    best_of = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=1.0,
                                        seed=5, n=2, best_of=3)
    assert penalised.choices[0].text == offline.text
    assert 4911 in offline.token_ids  # the bias made the token appear...
    assert offline.token_ids.count(4911) < 6  # ...and the frequency penalty made it stop repeating
    assert [c.text for c in best_of.choices] == [c.text for c in best]
    assert [c.index for c in best_of.choices] == [0, 1] and best_of.choices[0].logprobs is None
    assert best_of.usage.completion_tokens == sum(len(c.token_ids) for c in ref)


def test_openai_client_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": JSON_SCHEMA}}
    chat, completion = in_parallel(
        lambda: client.chat.completions.create(model=MODEL_NAME, max_tokens=40, temperature=0,
                                               messages=[{"role": "user", "content": "JSON please"}],
                                               response_format=rf),
        lambda: client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=40, temperature=0.8,
                                          seed=2, extra_body={"response_format": {"type": "json_object"}}))
    value = json.loads(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"
    assert set(value) == {"answer", "ok"} and value["answer"] in ("yes", "no")
    assert isinstance(value["ok"], bool)
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    else:  # an object the random model did not close in 40 tokens: still an object's prefix
        assert completion.choices[0].text.startswith("{")


async def _stream_completion(base: str, body: dict) -> tuple[list[dict], bool]:
    async with httpx.AsyncClient(timeout=300) as c:
        async with c.stream("POST", base + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200, await r.aread()
            raw = (await r.aread()).decode()
    return parse_sse(raw)


def test_32_concurrent_streams_mixed_lengths(server, llm):
    # 8 prompts of different lengths, each asked for 1..4 tokens: 32 streams in one batch.
    base_prompts = [[100 + i] * length + [2000 + i] for i, length in enumerate([0, 2, 4, 7, 1, 11, 3, 5])]
    ref = llm.generate([{"prompt_token_ids": p} for p in base_prompts], greedy(4, ignore_eos=True),
                       use_tqdm=False)
    tok = llm.get_tokenizer()
    cases = [(i, m) for m in (1, 2, 3, 4) for i in range(8)]
    for r in ref:  # the prefix rule below, anchored on the full text
        assert tok.decode(r.outputs[0].token_ids) == r.outputs[0].text
    # The payload `vllm bench serve --backend openai` sends.
    bodies = [{"model": MODEL_NAME, "prompt": base_prompts[i], "repetition_penalty": 1.0,
               "max_tokens": m, "logprobs": None, "ignore_eos": True, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
              for i, m in cases]

    before = server.metrics()
    max_running = []

    async def watch_running(stop: asyncio.Event):
        async with httpx.AsyncClient(timeout=30) as c:
            while not stop.is_set():
                text = (await c.get(server.base + "/metrics")).text
                running = [line for line in text.splitlines()
                           if line.startswith("deepinfer:num_requests_running{")]
                max_running.append(float(running[0].rsplit(" ", 1)[1]))
                await asyncio.sleep(0.05)

    async def run_all():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_running(stop))
        try:
            return await asyncio.gather(*[_stream_completion(server.base, b) for b in bodies])
        finally:
            stop.set()
            await watcher

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    # Requests from different HTTP clients ran in one batch.
    assert max(max_running) >= 8
    for (events, done), (i, m) in zip(results, cases):
        assert done, "stream must end with [DONE]"
        assert stream_text(events) == {0: tok.decode(ref[i].outputs[0].token_ids[:m])}
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == m
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    m = server.wait_metrics(lambda m: m["deepinfer:kv_blocks_used"] == 0, timeout_s=10)
    assert m["deepinfer:num_requests_running"] == 0 and m["deepinfer:num_requests_waiting"] == 0

    def grew(name):
        return m[name] - before[name]
    assert grew("deepinfer:time_to_first_token_seconds_count") == 32
    assert grew("deepinfer:inter_token_latency_seconds_count") == sum(m_ - 1 for _, m_ in cases)
    assert grew("deepinfer:generation_tokens_total") == sum(m_ for _, m_ in cases)
    assert grew("deepinfer:prompt_tokens_total") == sum(len(base_prompts[i]) for i, _ in cases)
    print(f"32 streams: {elapsed:.1f} s, max running {max(max_running):.0f}")


# ---- disconnects --------------------------------------------------------------------------------
def _aborts(m) -> float:
    return m.get('deepinfer:request_success_total{finished_reason="abort"}', 0.0)


def test_client_dropping_mid_stream_is_aborted_and_others_unaffected(server, llm):
    expected = offline_texts(llm, ["Once upon a time"], [4])[0]
    before = server.metrics()

    async def scenario():
        async def dropper():
            async with httpx.AsyncClient(timeout=300) as c:
                async with c.stream("POST", server.base + "/v1/completions",
                                    headers={"Authorization": f"Bearer {API_KEY}"},
                                    json={"model": MODEL_NAME, "prompt": "Hello there", "stream": True,
                                          "max_tokens": 200, "temperature": 0, "ignore_eos": True}) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            seen += 1
                            if seen == 2:
                                return seen  # leaving the context closes the connection
            return seen

        async def survivor():
            await asyncio.sleep(0.2)
            return await _stream_completion(server.base, {
                "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4,
                "temperature": 0, "stream": True})
        return await asyncio.gather(dropper(), survivor())

    seen, (events, done) = asyncio.run(scenario())
    assert seen == 2
    assert done and stream_text(events) == {0: expected}
    m = server.wait_metrics(lambda m: m["deepinfer:kv_blocks_used"] == 0
                            and m["deepinfer:num_requests_running"] == 0, timeout_s=20)
    assert _aborts(m) == _aborts(before) + 1
    # Far fewer than the 200 tokens the dropped request asked for were generated.
    generated = m["deepinfer:generation_tokens_total"] - before["deepinfer:generation_tokens_total"]
    assert generated < 60


def test_non_streaming_client_disconnect_is_aborted(server):
    before = server.metrics()
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 200,
                       "temperature": 0, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    server.wait_metrics(lambda m: m["deepinfer:kv_blocks_used"] > 0, timeout_s=20)
    sock.close()
    m = server.wait_metrics(lambda m: m["deepinfer:kv_blocks_used"] == 0
                            and _aborts(m) == _aborts(before) + 1, timeout_s=20)
    assert m["deepinfer:generation_tokens_total"] - before["deepinfer:generation_tokens_total"] < 60


# ---- malformed and hostile requests -------------------------------------------------------------
OK = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
NO_KEY, BAD_KEY = {}, {"Authorization": "Bearer wrong"}
USER_MSG = [{"role": "user", "content": "hi"}]

# (name, path, body, headers or None (= the right key), expected status, expected param or None)
BAD_REQUESTS = [
    ("invalid json", C, b'{"prompt": "hi", ', None, 400, None),
    ("body is a list", C, [1, 2], None, 400, None),
    ("body is not utf-8", C, b"\xff\xfe{}", None, 400, None),
    ("missing prompt", C, {"model": MODEL_NAME}, None, 400, "prompt"),
    ("prompt is a number", C, {**OK, "prompt": 5}, None, 400, "prompt"),
    ("prompt list of mixed types", C, {**OK, "prompt": ["a", 1]}, None, 400, "prompt"),
    ("max_tokens is a string", C, {**OK, "max_tokens": "16"}, None, 400, "max_tokens"),
    ("negative max_tokens", C, {**OK, "max_tokens": -1}, None, 400, "max_tokens"),
    ("huge max_tokens", C, {**OK, "max_tokens": 10**9}, None, 400, "max_tokens"),
    ("temperature above 2", C, {**OK, "temperature": 3.5}, None, 400, "temperature"),
    ("negative temperature", C, {**OK, "temperature": -0.5}, None, 400, "temperature"),
    ("top_p zero", C, {**OK, "top_p": 0.0}, None, 400, "top_p"),
    ("top_k below -1", C, {**OK, "top_k": -5}, None, 400, "top_k"),
    ("min_p above 1", C, {**OK, "min_p": 1.5}, None, 400, "min_p"),
    ("huge n", C, {**OK, "n": 100000}, None, 400, "n"),
    ("negative seed", C, {**OK, "seed": -1}, None, 400, "seed"),
    ("min_tokens above max_tokens", C, {**OK, "min_tokens": 5}, None, 400, "min_tokens"),
    ("logprobs too many", C, {**OK, "logprobs": 100}, None, 400, "logprobs"),
    ("stream is a string", C, {**OK, "stream": "yes"}, None, 400, "stream"),
    ("stream_options without stream", C, {**OK, "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("too many stop strings", C, {**OK, "stop": ["x"] * 100}, None, 400, "stop"),
    ("empty prompt", C, {**OK, "prompt": ""}, None, 400, "prompt"),
    ("empty prompt list", C, {**OK, "prompt": []}, None, 400, "prompt"),
    ("token id out of vocabulary", C, {**OK, "prompt": [999999]}, None, 400, "prompt"),
    ("negative token id", C, {**OK, "prompt": [[1, -1]]}, None, 400, "prompt"),
    ("prompt longer than max_model_len", C, {**OK, "prompt": [7] * (MAX_MODEL_LEN + 10)}, None, 400,
     "prompt"),
    ("prompt + max_tokens over max_model_len", C, {**OK, "prompt": [7] * 250, "max_tokens": 10}, None,
     400, "max_tokens"),
    ("too many prompts", C, {**OK, "prompt": ["a"] * 1000}, None, 400, "prompt"),
    ("unknown model", C, {**OK, "model": "gpt-4"}, None, 404, "model"),
    ("missing API key", C, OK, NO_KEY, 401, None),
    ("wrong API key", C, OK, BAD_KEY, 401, None),
    ("body over the size limit", C, {**OK, "prompt": "x" * (2 << 20)}, None, 413, None),
    ("best_of below n", C, {**OK, "n": 3, "best_of": 2}, None, 400, "best_of"),
    ("best_of streamed", C, {**OK, "n": 1, "best_of": 2, "stream": True}, None, 400, "best_of"),
    ("frequency_penalty above 2", C, {**OK, "frequency_penalty": 3}, None, 400, "frequency_penalty"),
    ("presence_penalty below -2", C, {**OK, "presence_penalty": -2.5}, None, 400, "presence_penalty"),
    ("repetition_penalty zero", C, {**OK, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    ("logit_bias key not a token id", C, {**OK, "logit_bias": {"abc": 1}}, None, 400, "logit_bias"),
    ("logit_bias id out of vocabulary", C, {**OK, "logit_bias": {"99999999": 1}}, None, 400,
     "logit_bias"),
    ("logit_bias above 100", C, {**OK, "logit_bias": {"5": 150}}, None, 400, "logit_bias"),
    ("invalid json schema", C, {**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, None, 400, "structured_outputs.json"),
    ("invalid regex", C, {**OK, "structured_outputs": {"regex": "(ab"}}, None, 400,
     "structured_outputs.regex"),
    ("two structured constraints", C, {**OK, "guided_choice": ["a"], "structured_outputs": {
        "regex": "a"}}, None, 400, None),
    ("unknown response_format type", C, {**OK, "response_format": {"type": "yaml"}}, None, 400,
     "response_format"),
    ("chat: invalid json schema", CHAT, {"messages": USER_MSG, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, None, 400,
     "structured_outputs.json"),
    ("unknown fields are ignored", C, {**OK, "frobnicate": {"x": 1}, "user": "u1"}, None, 200, None),
    ("chat: messages missing", CHAT, {"model": MODEL_NAME}, None, 400, "messages"),
    ("chat: messages empty", CHAT, {"messages": []}, None, 400, "messages"),
    ("chat: unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages"),
    ("chat: content is a number", CHAT, {"messages": [{"role": "user", "content": 3}]}, None, 400,
     "messages"),
    ("chat: tool without a function", CHAT, {"messages": USER_MSG, "tools": [{"type": "function"}]}, None,
     400, "tools"),
    ("chat: max_tokens zero", CHAT, {"messages": USER_MSG, "max_tokens": 0}, None, 400, "max_tokens"),
    ("chat: wrong key", CHAT, {"messages": USER_MSG}, BAD_KEY, 401, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD_REQUESTS,
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_documented_status(server, name, path, body, headers, status, param):
    r = post(server, path, body, headers=headers)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == status and err["message"]
        if param is not None:
            assert err["param"] == param


def test_wrong_method_and_unknown_route_are_openai_errors(server):
    r = httpx.get(server.base + C, headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = httpx.post(server.base + "/v1/nope", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_server_still_serves_after_bad_requests(server):
    for name, path, body, headers, status, _ in BAD_REQUESTS:
        if status != 200:
            assert post(server, path, body, headers=headers).status_code == status
    r = post(server, C, {"model": MODEL_NAME, "prompt": "def fibonacci(n):", "max_tokens": 2,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.base + "/health").status_code == 200
    m = server.wait_metrics(lambda m: m["deepinfer:kv_blocks_used"] == 0, timeout_s=10)
    assert m["deepinfer:engine_step_errors_total"] == 0

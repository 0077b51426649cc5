"""No request body gives a 500: random JSON values for every field the request models declare, sent
to the app in process (httpx ASGITransport) over a real tiny engine. Every answer is a 200, or an
OpenAI error whose status is documented (400 bad value, 404 unknown model, 501 unsupported) and
which names the field; a streamed answer carries no error event with code 500."""
import asyncio
import json
import random

import httpx
import pytest

from deepinfer.engine_config import EngineConfig
from deepinfer.serve.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.server import in_process_app

MODEL = "m"
NUM_BODIES = 300
ALLOWED = {200, 400, 404, 501}
_INTS = [-(2 ** 63), -100, -2, -1, 0, 1, 2, 3, 5, 20, 21, 33, 100, 2 ** 31, 2 ** 63, 10 ** 30]
_FLOATS = [-1e308, -3.0, -2.0, -0.5, 0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 1e308]
_STRINGS = ["", "x", "hi there", "json_object", "text", MODEL, "gpt-4", "\u00e9\u4e2d", "0", "{"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["null", "bool", "int", "float", "str", "list", "dict"] if depth < 2
                      else ["null", "bool", "int", "float", "str"])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(_INTS)
    if kind == "float":
        return rng.choice(_FLOATS)
    if kind == "str":
        return rng.choice(_STRINGS)
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = _STRINGS + ["type", "thinking", "include_usage", "role", "content", "json_schema", "schema"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _valid(field: str, rng: random.Random):
    """A plausible value for the fields that decide whether a request reaches the engine at all."""
    return {
        "prompt": rng.choice(["hello", [0, 5, 6], ["a b", "c"], [[0, 7], [3]]]),
        "messages": [{"role": "user", "content": "hi"}],
        "model": MODEL,
        "max_tokens": rng.choice([0, 1, 2, 3]),
        "max_completion_tokens": rng.choice([1, 2]),
    }[field]


def random_body(rng: random.Random, model_cls) -> dict:
    """The essential fields mostly valid (so most bodies reach the deeper checks), plus 0 to all of
    the other declared fields with random values (few fields: often served; many: often refused)."""
    essential = ("prompt", "messages", "model", "max_tokens", "max_completion_tokens")
    body = {name: _valid(name, rng) if rng.random() < 0.85 else random_value(rng)
            for name in model_cls.model_fields if name in essential}
    others = [name for name in model_cls.model_fields if name not in essential]
    for name in rng.sample(others, min(len(others), rng.choice([0, 0, 1, 1, 2, 3, 6, len(others)]))):
        body[name] = random_value(rng)
    if rng.random() < 0.1:
        body[rng.choice(_STRINGS[1:])] = random_value(rng)  # an unknown field
    return body


def _check(path: str, body: dict, r: httpx.Response) -> None:
    where = f"{path} {json.dumps(body)[:400]} -> {r.status_code} {r.text[:400]}"
    assert r.status_code in ALLOWED, where
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"], where
        assert err["param"], where  # every field-level error names its field
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        for block in r.text.split("\n\n"):
            if block.startswith("data: {"):
                event = json.loads(block[len("data: "):])
                assert event.get("error", {}).get("code") not in (500,), where
    else:
        assert r.json()["choices"] is not None, where


def test_random_bodies_never_get_a_500(tiny_v4_dir):
    config = EngineConfig(model=str(tiny_v4_dir), dtype="float32", max_model_len=64, max_num_seqs=16,
                          max_num_batched_tokens=256, num_kv_blocks=80)
    rng = random.Random(1234)
    cases = []
    for i in range(NUM_BODIES):
        path, cls = (("/v1/completions", CompletionRequest) if i % 2 == 0
                     else ("/v1/chat/completions", ChatCompletionRequest))
        cases.append((path, random_body(rng, cls)))

    async def scenario():
        statuses = {}
        async with in_process_app(config, MODEL) as (c, state):
            async def one(path, body):
                r = await c.post(path, json=body)
                _check(path, body, r)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

            for start in range(0, len(cases), 16):
                await asyncio.gather(*(one(p, b) for p, b in cases[start:start + 16]))
            stats = state.engine_loop.engine.stats()
        return statuses, stats

    statuses, stats = asyncio.run(scenario())
    # the bodies exercise both sides: some are served, some refused for a value, some unsupported
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 50, statuses
    assert stats.num_used_blocks == 0 and stats.num_running == 0

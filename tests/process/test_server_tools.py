"""Tool calling and reasoning output through a real `python -m serve` process on the tiny V4
checkpoint, driven by the official openai client as an agent would (random weights: the forced
call's grammar is what makes the calls well formed)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from deepinfer.tokenizer import load_tokenizer
from deepinfer.serve.chat_template import ChatTurn, ToolCall, render_chat
from tests.support.server import API_KEY, MODEL_NAME, model_dir_fixture, running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "metric": {"type": "boolean"}},
        "required": ["city", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return model_dir_fixture(request, tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    # The tools section alone is ~400 tokens: a longer context than the other server tests use.
    with running_server(model_dir, "--max-model-len", "1024") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "metric"} and args["city"] in ("Paris", "Tokyo")
    assert isinstance(args["metric"], bool)
    return args


def _prompt_tokens(model_dir, turns, **kw) -> int:
    return len(load_tokenizer(model_dir).encode(render_chat(turns, add_bos=False, **kw)))


def test_openai_tool_call_loop(client, model_dir):
    messages = list(QUESTION)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=400)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content  # the grammar ends in EOS
    assert choice.message.content is None and choice.message.tool_calls
    calls = choice.message.tool_calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    # The agent runs the tools and sends the results back, as the openai docs' loop does.
    messages.append(choice.message.model_dump(exclude_none=True))
    results = {c.id: f"result of\n\n{c.function.name}" for c in calls}
    # content parts, as some agents send them: a tool result's parts join with a blank line
    messages += [{"role": "tool", "tool_call_id": cid,
                  "content": [{"type": "text", "text": part} for part in text.split("\n\n")]}
                 for cid, text in results.items()]
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.role == "assistant"
    # The server saw the history in DSML: the call block, then the results in a user turn.
    turns = [ChatTurn("user", QUESTION[0]["content"]),
             ChatTurn("assistant", "", tool_calls=tuple(ToolCall(c.id, c.function.name,
                                                                 json.loads(c.function.arguments))
                                                        for c in calls))]
    turns += [ChatTurn("tool", text, tool_call_id=cid) for cid, text in results.items()]
    functions = [t["function"] for t in TOOLS]
    assert second.usage.prompt_tokens == _prompt_tokens(model_dir, turns, tools=functions)
    assert first.usage.prompt_tokens == _prompt_tokens(model_dir, turns[:1], tools=functions)


def test_streamed_named_call_arrives_as_tool_call_deltas(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, stream=True, temperature=0, max_tokens=400,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    _check_weather_args(calls[0].function.arguments)
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_and_auto_answer_with_text(client):
    none = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=4)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0,
                                           max_tokens=4)
    # none leaves the tools out of the prompt: the same reply as no tools at all
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_thinking_reply_is_reasoning_content(client, server, model_dir):
    body = dict(model=MODEL_NAME, messages=QUESTION, temperature=0, max_tokens=6,
                extra_body={"chat_template_kwargs": {"thinking": True}})
    full = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(stream=True, **body))
    # The same prompt through /v1/completions: the raw text the parser split.
    ids = load_tokenizer(model_dir).encode(render_chat([ChatTurn("user", QUESTION[0]["content"])],
                                                       thinking=True, add_bos=False))
    raw = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=6)
    text = raw.choices[0].text
    message = full.choices[0].message
    if "</think>" in text:  # the random model closed its reasoning
        reasoning, content = text.split("</think>", 1)
    else:  # never closed: all reasoning, cut by max_tokens
        reasoning, content = text, None
        assert full.choices[0].finish_reason == "length"
    assert message.reasoning_content == reasoning.removeprefix("<think>")
    assert message.content == (content or None)
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == message.reasoning_content
    assert "".join(d.content or "" for d in streamed) == (message.content or "")


def test_bad_tool_history_is_400(server):
    bad = [*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL_NAME, "messages": bad, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL_NAME, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
                         "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}]
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL_NAME, "messages": QUESTION, "tools": bad_schema,
                         "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # the server goes on serving
    ok = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=120,
                    json={"model": MODEL_NAME, "messages": QUESTION, "tools": bad_schema, "max_tokens": 2})
    assert ok.status_code == 200

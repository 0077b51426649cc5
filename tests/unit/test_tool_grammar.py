"""Forced tool calls (tool_choice required / a named function): the structural tag of
serve/tool_choice.py compiled by the engine's GrammarCompiler against the real DeepSeek
tokenizer. A random walk over the tokens each mask allows stands in for a model with random
weights; every walk must end (EOS) in a call block that parses into calls whose arguments
validate against their function's schema."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer.sampling_params import SamplingParamsError, StructuredOutputsParams
from deepinfer.structured_output import GrammarCompiler
from deepinfer.tokenizer import deepseek_tokenizer_dir, load_tokenizer
from deepinfer.serve.errors import APIError
from deepinfer.serve.reply_parser import ReplyParser, full_message
from deepinfer.serve.tool_choice import tool_spec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Zürich"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "parameters": {"type": "object", "properties": {
        "hours": {"type": "array", "items": {"type": "integer", "enum": [6, 7]}, "maxItems": 2},
        "label": {"enum": ["work", "gym"]}},
        "required": ["hours"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters at all
TOOLS = [WEATHER, ALARM, NOW]


def _check(arguments: dict, schema: dict) -> None:
    """The subset of JSON schema these tools use (no validator library is installed)."""
    props = schema.get("properties", {})
    assert set(schema.get("required", [])) <= set(arguments), arguments
    assert set(arguments) <= set(props), arguments
    for key, value in arguments.items():
        _check_value(value, props[key])


def _check_value(value, s: dict) -> None:
    if "enum" in s:
        assert value in s["enum"], (value, s)
    kind = s.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert s.get("minimum", value) <= value <= s.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "string":
        assert isinstance(value, str)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= s.get("maxItems", len(value))
        for item in value:
            _check_value(item, s["items"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(deepseek_tokenizer_dir())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])


def _walk(compiler, tag: str, seed: int, prefix_ids=(), max_steps: int = 400) -> list[int]:
    state = compiler.new_state(compiler.compile(StructuredOutputsParams(structural_tag=tag)))
    ids = list(prefix_ids)
    for t in ids:
        assert state.advance(t) is None
        state.refresh(())
    rng = random.Random(seed)
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(max_steps):
        bits = ((state.bitmask.unsqueeze(1) >> shifts) & 1).flatten()[:compiler.vocab_size]
        token = rng.choice(bits.nonzero().flatten().tolist())
        ids.append(token)
        if state.advance(token) is not None:
            return ids
        state.refresh(())
    raise AssertionError(f"walk {seed} did not end in {max_steps} tokens")


def _reply(tokenizer, ids, thinking: bool) -> tuple[dict, str]:
    text = tokenizer.decode(ids)  # as the server decodes: EOS is dropped
    parser = ReplyParser(reasoning=thinking, tool_calls=True)
    message = full_message(parser, text)
    return message, parser.finish_reason("stop")


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_are_well_formed_and_follow_their_schemas(compiler, tokenizer, seed):
    spec = tool_spec(TOOLS, "required", None)
    ids = _walk(compiler, spec.structural_tag(thinking=False), seed)
    assert ids[-1] == tokenizer.eos_token_id
    message, finish = _reply(tokenizer, ids, thinking=False)
    assert finish == "tool_calls" and message["content"] is None, message
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    assert message["tool_calls"]
    for call in message["tool_calls"]:
        _check(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize("seed", range(4))
def test_named_function_is_called_exactly_once(compiler, tokenizer, seed):
    spec = tool_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    message, finish = _reply(tokenizer, _walk(compiler, spec.structural_tag(False), seed), False)
    assert finish == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    _check(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_thinking_reasoning_comes_first_then_the_call(compiler, tokenizer):
    spec = tool_spec([NOW], "required", False)
    reasoning = tokenizer.encode("I should check the clock.</think>", add_bos=False)
    ids = _walk(compiler, spec.structural_tag(thinking=True), 0, prefix_ids=reasoning)
    message, finish = _reply(tokenizer, ids, thinking=True)
    assert message["reasoning_content"] == "I should check the clock."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {}
    assert finish == "tool_calls"


def test_a_schema_xgrammar_rejects_is_a_sampling_error(compiler):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                        "properties": {"x": {"type": 5}}}}}
    with pytest.raises(SamplingParamsError):
        compiler.compile(StructuredOutputsParams(structural_tag=tool_spec([bad], "required", None)
                                                 .structural_tag(False)))


@pytest.mark.parametrize("tools,choice,parallel", [
    ([{"type": "function"}], None, None),
    ([{"type": "function", "function": {"name": "has space"}}], None, None),
    ([NOW, NOW], None, None),
    ([NOW], "sometimes", None),
    ([NOW], {"type": "function", "function": {"name": "missing"}}, None),
    (None, "required", None),
    ([NOW], "auto", "yes"),
])
def test_bad_tools_and_tool_choice_are_400(tools, choice, parallel):
    with pytest.raises(APIError) as e:
        tool_spec(tools, choice, parallel)
    assert e.value.status == 400


def test_tool_choice_modes():
    assert tool_spec(None, None, None) is None
    assert tool_spec([NOW], None, None).choice == "auto"
    none = tool_spec([NOW], "none", None)
    assert none.prompt_tools is None and not none.parses_calls and not none.forced
    assert tool_spec([NOW], "required", None).forced

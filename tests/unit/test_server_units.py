"""Server pieces without a server: chat template, request parsing, body limit (metrics:
test_metrics.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from deepinfer.serve.chat_template import ChatTurn, render_chat
from deepinfer.serve.errors import APIError
from deepinfer.serve.middleware import BodyLimitMiddleware
from deepinfer.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


# ---- chat template ------------------------------------------------------------------------------
def test_chat_mode_multi_turn():
    turns = [ChatTurn("system", "Be brief."), ChatTurn("user", "Hi"), ChatTurn("assistant", "Hello!"),
             ChatTurn("user", "2+2?")]
    assert render_chat(turns) == (f"{BOS}Be brief.{U}Hi{A}</think>Hello!{EOS}{U}2+2?{A}</think>")


def test_thinking_mode_opens_think_only_for_the_last_turn():
    turns = [ChatTurn("user", "Hi"), ChatTurn("assistant", "Hello!", reasoning_content="greet"),
             ChatTurn("user", "2+2?")]
    # Earlier reasoning is dropped; the reply to the last user turn starts a thinking block.
    assert render_chat(turns, thinking=True) == f"{BOS}{U}Hi{A}</think>Hello!{EOS}{U}2+2?{A}<think>"


def test_final_assistant_turn_is_continued_and_consecutive_users_share_a_reply():
    # The encoding merges user turns in a row into one, joined by a blank line.
    turns = [ChatTurn("user", "a"), ChatTurn("user", "b"), ChatTurn("assistant", "par")]
    assert render_chat(turns, add_bos=False) == f"{U}a\n\nb{A}</think>par"


def test_bad_role_and_empty_messages_are_rejected():
    with pytest.raises(ValueError, match="role"):
        render_chat([ChatTurn("function", "x")])
    with pytest.raises(ValueError, match="at least one"):
        render_chat([])


# ---- request parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    (b"not json", None), (b"[]", None), (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens"), (b'{"prompt": "x", "echo": 1}', "echo"),
    (b'{"prompt": [1, true]}', "prompt"),
])
def test_parse_body_errors_are_400_with_param(raw, param):
    with pytest.raises(APIError) as e:
        parse_body(raw, CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_completion_request_defaults_and_sampling_params():
    req = parse_body(b'{"prompt": "x", "extra_field": 1}', CompletionRequest)
    req.check()
    assert req.max_tokens == 16 and req.model_extra == {"extra_field": 1}
    sp = req.sampling_params(16, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1.0, 1.0, -1, 16)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, 501, "suffix"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 2}, 400, "min_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, None, None),
    ({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0}, None, None),
    ({"prompt": "x", "best_of": 1, "n": 2}, None, None),
])
def test_completion_request_checks(body, status, param):
    req = parse_body(json.dumps(body).encode(), CompletionRequest)
    if status is None:
        req.check()
        req.sampling_params(4, None)
        return
    with pytest.raises(APIError) as e:
        req.check()
        req.sampling_params(4, None)
    assert (e.value.status, e.value.param) == (status, param)


@pytest.mark.parametrize("top", [-1, 21])
def test_chat_top_logprobs_out_of_range_names_top_logprobs(top):
    req = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                 "top_logprobs": top}).encode(), ChatCompletionRequest)
    with pytest.raises(APIError) as e:
        req.check()
    assert (e.value.status, e.value.param) == (400, "top_logprobs")


def test_chat_request_thinking_switch_and_limits():
    req = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}],
                                 "chat_template_kwargs": {"thinking": True},
                                 "max_completion_tokens": 5}).encode(), ChatCompletionRequest)
    req.check()
    assert req.thinking is True and req.max_new_tokens == 5


# ---- body limit ---------------------------------------------------------------------------------
def test_body_limit_applies_to_chunked_bodies_without_content_length():
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def run(chunks):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]
        sent = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        await BodyLimitMiddleware(app, max_bytes=2000)(scope, receive, send)
        return sent[0]["status"]

    assert asyncio.run(run([b"x" * 1500, b"y" * 400])) == 200
    assert seen["body"] == b"x" * 1500 + b"y" * 400
    assert asyncio.run(run([b"x" * 1500, b"y" * 600])) == 413

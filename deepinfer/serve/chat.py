"""POST /v1/chat/completions: messages rendered with the DeepSeek V4 chat format."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

from starlette.requests import Request
from starlette.responses import Response

from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.serve.chat_template import ROLES, ChatTurn, ToolCall, render_chat
from deepinfer.serve.completions import check_length
from deepinfer.serve.errors import APIError, bad_request, not_implemented
from deepinfer.serve.generation import EnginePrompt, Generation, respond, sse_body
from deepinfer.serve.protocol import ChatCompletionRequest, ChatMessage, parse_body
from deepinfer.serve.reply_parser import ReplyParser, full_message, merge_fields
from deepinfer.serve.responses import ChoiceState, chat_logprobs, new_id, now_s, sse, usage
from deepinfer.serve.state import ServerState

logger = logging.getLogger(__name__)


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    req.check()
    state.check_model(req.model)
    state.engine_loop.check_available()
    state.require_tokenizer("a chat completion", "messages")
    turns = [_turn(i, m) for i, m in enumerate(req.messages)]
    tools = req.tool_spec()
    try:
        text = render_chat(turns, thinking=req.thinking, add_bos=False,
                           tools=tools.prompt_tools if tools else None)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    engine = state.engine
    token_ids = await asyncio.to_thread(_encode_chat, engine.tokenizer, text,
                                        engine.model_config.bos_token_id)
    max_tokens = check_length(len(token_ids), req.max_new_tokens, state.max_model_len)
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(max_tokens, num_top)
    if tools is not None and tools.forced:
        tag = StructuredOutputsParams(structural_tag=tools.structural_tag(req.thinking))
        params = dataclasses.replace(params, structured_outputs=tag)
    ctx = _Context(req, state, len(token_ids), new_id("chatcmpl"),
                   reasoning=req.thinking and state.config.reasoning_parser is not None,
                   tool_calls=tools is not None and tools.parses_calls)
    state.check_capacity(1)
    gen = Generation(state.engine_loop, ctx.id, [EnginePrompt(token_ids, text)], [params])
    try:
        return await respond(request, gen, (lambda g: sse_body(_events(ctx, g), g, f"chat stream {ctx.id}")) if req.stream else None,
                             lambda finals: _full_response(ctx, finals[0]))
    except APIError as e:
        if e.param != "structured_outputs.structural_tag":
            raise
        # The only structural tag here is the forced call's: its schemas are the client's tools.
        reason = e.message.split(": ", 1)[-1]
        raise bad_request(f"tools: a parameters schema cannot constrain the forced call: {reason}",
                          "tools") from None


def _turn(i: int, m: ChatMessage) -> ChatTurn:
    if m.role not in ROLES:
        raise bad_request(f"messages[{i}].role must be one of {ROLES}, got {m.role!r}", "messages")
    if m.tool_calls and m.role != "assistant":
        raise bad_request(f"messages[{i}]: only assistant messages have tool_calls", "messages")
    # The encoding joins a tool result's text parts with a blank line.
    content = _text(i, m.content, "\n\n" if m.role == "tool" else "\n")
    if content is None:
        if m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}", "messages")
        content = ""
    calls = tuple(_history_call(f"messages[{i}].tool_calls[{k}]", c)
                  for k, c in enumerate(m.tool_calls or []))
    return ChatTurn(m.role, content, m.reasoning_content, calls,
                    m.tool_call_id if m.role == "tool" else None)


def _text(i: int, content, separator: str) -> str | None:
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise not_implemented(f"messages[{i}]: only text content parts are supported, got "
                                  f"{part.type!r}", "messages")
        texts.append(part.text)
    return separator.join(texts)


def _history_call(where: str, call) -> ToolCall:
    """An assistant message's OpenAI tool call; its arguments must be a JSON object's text."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          f"\"arguments\": ...}}}}", "messages")
    raw = function.get("arguments", "{}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be the JSON text of an object", "messages")
    call_id = call.get("id")
    return ToolCall(call_id if isinstance(call_id, str) else "", name, arguments)


def _encode_chat(tokenizer, text: str, bos_token_id: int | None) -> list[int]:
    # The template's BOS is added as an id, so it appears exactly once whether or not the
    # tokenizer prepends BOS itself.
    ids = list(tokenizer.encode(text))
    if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
        ids.insert(0, int(bos_token_id))
    return ids


class _Context:
    def __init__(self, req: ChatCompletionRequest, state: ServerState, prompt_tokens: int,
                 request_id: str, reasoning: bool, tool_calls: bool):
        self.req = req
        self.reasoning = reasoning  # split the reply at </think> (thinking mode, parser on)
        self.tool_calls = tool_calls  # parse DSML call blocks out of the answer
        self.state = state
        self.prompt_tokens = prompt_tokens
        self.id = request_id
        self.created = now_s()
        self.model = state.config.served_model_name

    def envelope(self, obj: str, choices: list[dict], usage_obj=None, stream: bool = False) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if not stream or self.req.include_usage:
            body["usage"] = usage_obj
        return body

    def reply_parser(self) -> ReplyParser:
        return ReplyParser(self.reasoning, self.tool_calls)

    def logprobs(self, entries) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(entries or [], self.state.tokenizer, self.req.top_logprobs or 0)


def _full_response(ctx: _Context, out) -> dict:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        parser = ctx.reply_parser()
        message = full_message(parser, c.text)
        choices.append({"index": c.index, "message": message, "logprobs": ctx.logprobs(c.logprobs),
                        "finish_reason": parser.finish_reason(c.finish_reason),
                        "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return ctx.envelope("chat.completion", choices, usage(ctx.prompt_tokens, completion_tokens,
                                                         out.num_cached_tokens))


async def _events(ctx: _Context, gen: Generation):
    states: dict[int, ChoiceState] = {}
    parsers: dict[int, ReplyParser] = {}
    completion_tokens: dict[int, int] = {}
    cached_tokens = 0
    async for _, out in gen.outputs():
        cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            st = states.setdefault(c.index, ChoiceState())
            if not st.advance(c):
                continue
            completion_tokens[c.index] = st.num_tokens
            parser = parsers.setdefault(c.index, ctx.reply_parser())
            delta = parser.feed(c.delta_text)
            if c.finish_reason is not None:
                delta = merge_fields(delta, parser.finish())
            if not st.started:
                st.started = True
                delta = {"role": "assistant", **delta}
            elif not delta and c.finish_reason is None and not ctx.req.logprobs:
                continue  # everything this delta brought is held back
            if not delta.keys() & {"content", "reasoning_content", "tool_calls"}:
                delta["content"] = ""
            choice = {"index": c.index, "delta": delta,
                      "finish_reason": parser.finish_reason(c.finish_reason),
                      "stop_reason": c.stop_reason, "logprobs": ctx.logprobs(c.delta_logprobs)}
            yield sse(ctx.envelope("chat.completion.chunk", [choice], stream=True))
    if ctx.req.include_usage:
        yield sse(ctx.envelope("chat.completion.chunk", [],
                               usage(ctx.prompt_tokens, sum(completion_tokens.values()),
                                     cached_tokens),
                               stream=True))

"""POST /v1/chat/completions: messages rendered with the DeepSeek V4 chat format."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import Response

from serve.chat_template import ROLES, ChatTurn, render_chat
from serve.completions import check_length
from serve.errors import APIError, bad_request, not_implemented, sse_error_event
from serve.generation import EnginePrompt, Generation, respond
from serve.protocol import ChatCompletionRequest, ChatMessage, parse_body
from serve.responses import SSE_DONE, ChoiceState, chat_logprobs, new_id, now_s, sse, usage
from serve.state import ServerState

logger = logging.getLogger("serve")


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    req.check()
    state.check_model(req.model)
    state.engine_loop.check_available()
    state.require_tokenizer("a chat completion", "messages")
    turns = [_turn(i, m) for i, m in enumerate(req.messages)]
    try:
        text = render_chat(turns, thinking=req.thinking, add_bos=False)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    engine = state.engine
    token_ids = await asyncio.to_thread(_encode_chat, engine.tokenizer, text,
                                        engine.model_config.bos_token_id)
    max_tokens = check_length(len(token_ids), req.max_new_tokens, state.max_model_len)
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(max_tokens, num_top)
    ctx = _Context(req, state, len(token_ids), new_id("chatcmpl"))
    state.check_capacity(1)
    gen = Generation(state.engine_loop, ctx.id, [EnginePrompt(token_ids, text)], [params])
    return await respond(request, gen, (lambda g: _stream(ctx, g)) if req.stream else None,
                         lambda finals: _full_response(ctx, finals[0]))


def _turn(i: int, m: ChatMessage) -> ChatTurn:
    if m.role in ("tool", "function"):
        raise not_implemented(f"messages[{i}]: role {m.role!r} (tool calling) is not supported", "messages")
    if m.role not in ROLES:
        raise bad_request(f"messages[{i}].role must be one of {ROLES}, got {m.role!r}", "messages")
    if m.tool_calls:
        raise not_implemented(f"messages[{i}]: tool_calls are not supported", "messages")
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise not_implemented(f"messages[{i}]: only text content parts are supported, got "
                                      f"{part.type!r}", "messages")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None:
        if m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}", "messages")
        content = ""
    return ChatTurn(m.role, content, m.reasoning_content)


def _encode_chat(tokenizer, text: str, bos_token_id: int | None) -> list[int]:
    # The template's BOS is added as an id, so it appears exactly once whether or not the
    # tokenizer prepends BOS itself.
    ids = list(tokenizer.encode(text))
    if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
        ids.insert(0, int(bos_token_id))
    return ids


class _Context:
    def __init__(self, req: ChatCompletionRequest, state: ServerState, prompt_tokens: int,
                 request_id: str):
        self.req = req
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

    def logprobs(self, entries) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(entries or [], self.state.tokenizer, self.req.top_logprobs or 0)


def _full_response(ctx: _Context, out) -> dict:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": ctx.logprobs(c.logprobs), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return ctx.envelope("chat.completion", choices, usage(ctx.prompt_tokens, completion_tokens,
                                                         out.num_cached_tokens))


async def _stream(ctx: _Context, gen: Generation):
    states: dict[int, ChoiceState] = {}
    completion_tokens: dict[int, int] = {}
    cached_tokens = 0
    try:
        try:
            async for _, out in gen.outputs():
                cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    st = states.setdefault(c.index, ChoiceState())
                    if not st.advance(c):
                        continue
                    completion_tokens[c.index] = st.num_tokens
                    delta = {"content": c.delta_text}
                    if not st.started:
                        st.started = True
                        delta = {"role": "assistant", "content": c.delta_text}
                    choice = {"index": c.index, "delta": delta, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason, "logprobs": ctx.logprobs(c.delta_logprobs)}
                    yield sse(ctx.envelope("chat.completion.chunk", [choice], stream=True))
            if ctx.req.include_usage:
                yield sse(ctx.envelope("chat.completion.chunk", [],
                                       usage(ctx.prompt_tokens, sum(completion_tokens.values()),
                                             cached_tokens),
                                       stream=True))
        except APIError as e:
            yield sse_error_event(e.status, e.message, e.param)
        except Exception as e:  # noqa: BLE001 - contained to this stream
            logger.exception("chat stream %s failed", ctx.id)
            yield sse_error_event(500, f"internal error: {e!r}")
        yield SSE_DONE
    finally:
        gen.abort()

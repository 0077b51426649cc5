"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deepinfer.serve.errors import bad_request
from deepinfer.serve.generation import EnginePrompt, Generation, respond, sse_body
from deepinfer.serve.protocol import MAX_CHOICES, MAX_PROMPTS, CompletionRequest, parse_body
from deepinfer.serve.responses import (SSE_DONE, ChoiceState, completion_logprobs, echo_logprobs,
                                       join_logprobs, new_id, now_s, sse, usage)
from deepinfer.serve.state import ServerState

logger = logging.getLogger(__name__)


async def create_completion(request: Request, state: ServerState) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    req.check()
    req.sampling_params(req.max_tokens or None, req.logprobs)  # reject bad fields before tokenizing
    state.check_model(req.model)
    state.engine_loop.check_available()
    if req.echo:
        state.require_tokenizer("echo", "echo")
    if req.logprobs is not None:
        state.require_tokenizer("logprobs (their token strings)", "logprobs")
    if isinstance(req.prompt, str) or (isinstance(req.prompt, list) and any(isinstance(p, str) for p in req.prompt)):
        state.require_tokenizer("a text prompt", "prompt")
    prompts = await asyncio.to_thread(_engine_prompts, req.prompt, state.tokenizer, state.vocab_size)
    if len(prompts) * req.num_sequences > MAX_CHOICES:
        param = "best_of" if req.num_sequences > req.n else "n"
        raise bad_request(f"{len(prompts)} prompts x {param}={req.num_sequences} exceeds {MAX_CHOICES} "
                          f"choices", param)
    max_model_len = state.max_model_len
    max_tokens = [check_length(len(p.token_ids), req.max_tokens, max_model_len) for p in prompts]
    ctx = _Context(req, state, prompts, new_id("cmpl"))
    if req.max_tokens == 0 and not req.scoring_only:  # echo only (check() allows 0 just with echo)
        return _echo_only(ctx)
    # Scoring only (max_tokens 0) still samples one token, dropped from the answer: the prompt's last
    # logits row is its sampling row, so that costs no extra forward, and the engine keeps one path.
    params = [req.sampling_params(max(m, 1), _engine_logprobs(req), n=req.num_sequences) for m in max_tokens]
    if req.echo and req.logprobs is not None:
        params = [dataclasses.replace(p, prompt_logprobs=req.logprobs) for p in params]
    state.check_capacity(len(prompts))
    gen = Generation(state.engine_loop, ctx.id, prompts, params)
    return await respond(request, gen, (lambda g: sse_body(_events(ctx, g), g, f"completion stream {ctx.id}")) if req.stream else None,
                         lambda finals: _full_response(ctx, finals))


def _engine_logprobs(req: CompletionRequest) -> int | None:
    # best_of ranks by cumulative logprob, so the engine must report the sampled tokens' logprobs
    # even when the client did not ask for them (they are then left out of the response).
    if req.logprobs is None and req.num_sequences > req.n:
        return 0
    return req.logprobs


def best_completions(outputs, n: int) -> list:
    """The n completions with the highest cumulative logprob (ties: lower index), re-indexed 0..n-1
    in that order; all of them, as they are, when there are only n."""
    if len(outputs) <= n:
        return sorted(outputs, key=lambda c: c.index)
    ranked = sorted(outputs, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    for i, c in enumerate(ranked):
        c.index = i
    return ranked


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens to generate for a prompt (None: up to the context), or a 400."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {prompt_len} tokens, which leaves no room for a completion. Please reduce the "
            f"length of the prompt.", "prompt")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
            f"in the completion). Please reduce the length of the prompt or completion.",
            "max_tokens")
    return max_tokens


def _engine_prompts(prompt, tokenizer, vocab_size: int) -> list[EnginePrompt]:
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]  # one prompt given as token ids
    else:
        items = list(prompt)
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"prompt list has {len(items)} prompts; at most {MAX_PROMPTS} are allowed",
                          "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            prompts.append(EnginePrompt(list(tokenizer.encode(item)), item))
        else:
            prompts.append(EnginePrompt(check_token_ids(item, vocab_size), None))
    return prompts


def check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise bad_request("prompt must not be empty", "prompt")
    for t in ids:
        if t < 0:
            raise bad_request(f"prompt token ids must be greater than or equal to 0, got {t}", "prompt")
        if t >= vocab_size:
            raise bad_request(f"prompt token id {t} is out of vocabulary (vocab size {vocab_size})",
                              "prompt")
    return list(ids)


class _Context:
    def __init__(self, req: CompletionRequest, state: ServerState, prompts: list[EnginePrompt],
                 request_id: str):
        self.req = req
        self.state = state
        self.prompts = prompts
        self.id = request_id
        self.created = now_s()
        self.model = state.config.served_model_name
        self._echo_text: dict[int, str] = {}

    def echo_text(self, index: int) -> str:
        if not self.req.echo:
            return ""
        if index not in self._echo_text:
            p = self.prompts[index]
            text = p.text if p.text is not None else self.state.tokenizer.decode(p.token_ids)
            self._echo_text[index] = text
        return self._echo_text[index]

    def envelope(self, choices: list[dict], usage_obj=None, stream: bool = False) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if not stream or self.req.include_usage:
            body["usage"] = usage_obj
        return body

    def prompt_part(self, out):
        """The echoed prompt's `logprobs` part (echo with logprobs), None otherwise or when the
        request ended before its prompt was scored (an abort)."""
        if not self.req.echo or self.req.logprobs is None or out.prompt_logprobs is None:
            return None
        return echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.state.tokenizer)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


def _choice(index: int, text: str, logprobs, finish_reason, stop_reason=None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def _full_response(ctx: _Context, finals: list) -> dict:
    choices, completion_tokens = [], 0
    tokenizer = ctx.state.tokenizer
    scoring = ctx.req.scoring_only
    for p_index, out in enumerate(finals):
        echo = ctx.echo_text(p_index)
        head = ctx.prompt_part(out)
        # Usage counts every generated token, the best_of - n completions left out included; scoring
        # only: the one sampled token is not part of the answer.
        if not scoring:
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        for c in best_completions(out.outputs, ctx.req.n):
            text, entries = ("", []) if scoring else (c.text, c.logprobs or [])
            logprobs = None
            if ctx.req.logprobs is not None:
                logprobs = join_logprobs(head, completion_logprobs(entries, tokenizer, len(echo)))
            choices.append(_choice(p_index * ctx.req.n + c.index, echo + text, logprobs,
                                   "length" if scoring else c.finish_reason,
                                   None if scoring else c.stop_reason))
    return ctx.envelope(choices, usage(ctx.prompt_tokens, completion_tokens,
                                       sum(out.num_cached_tokens for out in finals)))


def _echo_only(ctx: _Context) -> Response:
    choices = [_choice(p * ctx.req.n + i, ctx.echo_text(p), None, "length")
               for p in range(len(ctx.prompts)) for i in range(ctx.req.n)]
    if not ctx.req.stream:
        return JSONResponse(ctx.envelope(choices, usage(ctx.prompt_tokens, 0)))

    async def events():
        for choice in choices:
            yield sse(ctx.envelope([choice], stream=True))
        if ctx.req.include_usage:
            yield sse(ctx.envelope([], usage(ctx.prompt_tokens, 0), stream=True))
        yield SSE_DONE
    return StreamingResponse(events(), media_type="text/event-stream")


async def _events(ctx: _Context, gen: Generation):
    n = ctx.req.n
    tokenizer = ctx.state.tokenizer
    states: dict[int, ChoiceState] = {}
    completion_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    scoring = ctx.req.scoring_only
    async for p_index, out in gen.outputs():
        cached_tokens[p_index] = out.num_cached_tokens
        for c in out.outputs:
            index = p_index * n + c.index
            st = states.setdefault(index, ChoiceState())
            if scoring and not c.finished():
                continue  # the answer is the scored prompt, sent once, when it finishes
            if not st.advance(c):
                continue
            delta, entries = ("", []) if scoring else (c.delta_text, c.delta_logprobs or [])
            finish, stop_reason = ("length", None) if scoring else (c.finish_reason, c.stop_reason)
            completion_tokens[index] = 0 if scoring else st.num_tokens
            prefix, head = "", None
            if not st.started:
                st.started = True
                prefix, head = ctx.echo_text(p_index), ctx.prompt_part(out)
            logprobs = None
            if ctx.req.logprobs is not None:
                # offsets count the echoed prompt too, as in the non-streamed answer
                offset = len(ctx.echo_text(p_index)) + st.num_chars - len(c.delta_text)
                logprobs = join_logprobs(head, completion_logprobs(entries, tokenizer, offset))
            yield sse(ctx.envelope([_choice(index, prefix + delta, logprobs, finish,
                                            stop_reason)], stream=True))
    if ctx.req.include_usage:
        yield sse(ctx.envelope([], usage(ctx.prompt_tokens, sum(completion_tokens.values()),
                                         sum(cached_tokens.values())), stream=True))

"""OpenAI response objects (plain dicts) built from RequestOutputs, plus the SSE framing."""

from __future__ import annotations

import json
import math
import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ChoiceState:
    """What one streamed choice has sent. The engine hands over each output's delta
    (CompletionOutput.delta_*); this only remembers the choice's running totals and whether its
    first and last chunks went out."""

    __slots__ = ("num_chars", "num_tokens", "finished", "started")

    def __init__(self):
        self.num_chars = 0  # text sent so far (the completions API's text_offset)
        self.num_tokens = 0  # tokens sent so far (usage)
        self.finished = False
        self.started = False

    def advance(self, completion) -> bool:
        """Count `completion`'s delta as sent; False when it has nothing to send: no new text or
        tokens and no finish not yet reported (a finished sibling repeats in later outputs of an
        n > 1 request)."""
        if self.finished:
            return False
        finishing = completion.finish_reason is not None
        if not completion.delta_text and not completion.delta_token_ids and not finishing:
            return False
        self.num_chars += len(completion.delta_text)
        self.num_tokens += len(completion.delta_token_ids)
        self.finished = finishing
        return True


def token_text(tokenizer, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id])
    except Exception:  # noqa: BLE001 - a token that does not decode alone still gets a label
        return f"token_id:{token_id}"


def _lp_value(lp) -> float:
    value = float(getattr(lp, "logprob", lp))
    # JSON has no NaN / -inf; OpenAI clients expect numbers.
    if math.isnan(value):
        return -9999.0
    return max(value, -9999.0)


def completion_logprobs(entries: list[dict], tokenizer, text_offset: int) -> dict:
    """The /v1/completions `logprobs` object of some output tokens. Each entry maps token id ->
    logprob with the sampled token first (deepinfer.outputs.SampleLogprobs)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        items = list(entry.items())
        token_id, lp = items[0]
        token = token_text(tokenizer, token_id)
        tokens.append(token)
        token_logprobs.append(_lp_value(lp))
        top_logprobs.append({token_text(tokenizer, t): _lp_value(v) for t, v in items})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def echo_logprobs(prompt_token_ids: list[int], prompt_logprobs, tokenizer) -> dict:
    """The prompt's part of a /v1/completions `logprobs` object (echo): its first token has no
    prefix, so its logprob and top list are null, as OpenAI returns them; the others come from
    RequestOutput.prompt_logprobs (the prompt token first, then the top-k)."""
    first = token_text(tokenizer, prompt_token_ids[0])
    rest = completion_logprobs(list(prompt_logprobs[1:]), tokenizer, len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def join_logprobs(head: dict | None, tail: dict) -> dict:
    """Two `logprobs` objects of consecutive text (echoed prompt, then completion) as one."""
    if head is None:
        return tail
    return {key: head[key] + tail[key] for key in tail}


def chat_logprobs(entries: list[dict], tokenizer, num_top: int) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        items = list(entry.items())
        token_id, lp = items[0]
        token = token_text(tokenizer, token_id)
        ranked = sorted(items, key=lambda kv: -_lp_value(kv[1]))[:num_top]
        content.append({
            "token": token, "logprob": _lp_value(lp), "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": (t := token_text(tokenizer, tid)), "logprob": _lp_value(v),
                              "bytes": list(t.encode("utf-8"))} for tid, v in ranked]})
    return {"content": content}


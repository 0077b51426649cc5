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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceState:
    """What one choice has already sent, so each chunk carries only the new text and tokens."""

    __slots__ = ("num_chars", "num_tokens", "finished", "started")

    def __init__(self):
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False
        self.started = False

    def advance(self, completion) -> tuple[str, int, int] | None:
        """(delta text, first new token index, new token count), or None when nothing changed.

        The engine's text only grows while a request runs (it holds back a possible stop-string
        prefix), so the delta is the tail past what was sent.
        """
        text = completion.text or ""
        num_tokens = len(completion.token_ids)
        finishing = completion.finish_reason is not None and not self.finished
        if num_tokens == self.num_tokens and len(text) <= self.num_chars and not finishing:
            return None
        delta = text[self.num_chars:]
        start = self.num_tokens
        self.num_chars = max(self.num_chars, len(text))
        self.num_tokens = num_tokens
        self.finished = completion.finish_reason is not None
        return delta, start, num_tokens - start


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


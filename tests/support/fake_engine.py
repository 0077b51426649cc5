"""A scripted engine for the server tests that need no model: one token per step per request, a
prompt token that makes the step raise, a prompt token the engine rejects."""

from __future__ import annotations

import time
from types import SimpleNamespace

from deepinfer.outputs import CompletionOutput, RequestOutput

POISON = 666  # a prompt token that makes the fake engine's step raise


class FakeTokenizer:
    def encode(self, text):
        if text == "explode":
            raise RuntimeError("tokenizer bug")
        return [0] + [ord(c) % 100 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class FakeEngine:
    """One token per step per request; token i of a request is 10 + i, its text "<10+i>"."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(max_model_len=64)
        self.model_config = SimpleNamespace(bos_token_id=0)
        self.vocab_size = 1000
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        ids = prompt["prompt_token_ids"]
        if 999 in ids:
            raise ValueError("token 999 is rejected by the engine")
        self.requests[request_id] = {"ids": ids, "out": [], "sent": 0, "max": params.max_tokens}

    def _output(self, rid, req, finish):
        # As LLMEngine: the whole output so far plus the delta since this request's last output.
        out, new = req["out"], req["out"][req["sent"]:]
        req["sent"] = len(out)
        return RequestOutput(rid, None, req["ids"], [CompletionOutput(
            0, "".join(f"<{t}>" for t in out), list(out), finish_reason=finish,
            delta_text="".join(f"<{t}>" for t in new), delta_token_ids=new)], finish is not None)

    def abort_request(self, rid):
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        self.aborted.append(rid)
        return self._output(rid, req, "abort")

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.01)
        if any(POISON in r["ids"] for r in self.requests.values()):
            raise RuntimeError("kernel exploded")
        outs = []
        for rid, req in list(self.requests.items()):
            req["out"].append(10 + len(req["out"]))
            done = len(req["out"]) >= req["max"]
            outs.append(self._output(rid, req, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def stats(self):
        return SimpleNamespace(num_running=len(self.requests), num_waiting=0,
                               num_used_blocks=len(self.requests), num_free_blocks=10,
                               num_prompt_tokens=0, num_generation_tokens=0, num_preemptions=0)

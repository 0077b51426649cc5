"""SamplingParams: vLLM's names and defaults, validated with errors that name the field and range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# docs/model.md §6.1: temperature below this is greedy; the sampler clamps T to it (DI).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63  # exclusive; vLLM bounds seeds to the int64 range


class SamplingParamsError(ValueError):
    """A bad sampling field. `param` names it, so the server can answer 400 with `param` set."""

    def __init__(self, param: str, message: str, value: object = None):
        super().__init__(message)
        self.param = param
        self.value = value


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fail(name: str, rule: str, value: object) -> None:
    raise SamplingParamsError(name, f"{name} must be {rule} (got {value!r})", value)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names). temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N per output token, 0..20; 0 = only the sampled token
    prompt_logprobs: int | None = None  # top-N per prompt token (raw model distribution), 0..20
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Normalised copy of `stop`, always a list (filled in __post_init__).
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", "an integer >= 1", self.n)
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", "a finite number >= 0", self.temperature)
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            _fail("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", "-1 or 0 (disabled) or an integer >= 1", self.top_k)
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            _fail("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < MAX_SEED)):
            _fail("seed", "None or an integer in [0, 2**63)", self.seed)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", "None or an integer >= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)):
            _fail("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not (0 <= self.prompt_logprobs <= MAX_LOGPROBS)):
            _fail("prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "a bool", getattr(self, name))
        self.stop_strings = self._normalise_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "None or a list of integers >= 0", self.stop_token_ids)
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.is_greedy:
            # DI sampling_params.py: greedy resets top-p/top-k; min_p is moot under argmax (vLLM resets it).
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            _fail("stop", "None, a non-empty string or a list of non-empty strings", stop)
        return list(items)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_temperature(self) -> float:
        """The temperature the sampler divides by (greedy clamps to 1e-5, docs/model.md §6.1)."""
        return max(float(self.temperature), GREEDY_TEMPERATURE)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

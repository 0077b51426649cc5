"""SamplingParams: vLLM's names and defaults, validated with errors that name the field and range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# docs/model.md §6.1: temperature below this is greedy; the sampler clamps T to it (upstream DeepInfer).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63  # exclusive; vLLM bounds seeds to the int64 range
MAX_PENALTY = 2.0  # presence / frequency: OpenAI documents [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias in [-100, 100]


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


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams names); exactly one field is set.

    json: a JSON schema (dict or its JSON text); regex: a regular expression; choice: the output is
    exactly one of these strings; grammar: an EBNF grammar (xgrammar's GBNF dialect); json_object:
    any JSON object; structural_tag: an xgrammar structural tag (its JSON text; the server's forced
    tool calls, serve/tool_choice.py). Compiled against the model's vocabulary when the request is
    added.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        param = "structured_outputs"
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise SamplingParamsError(
                param, f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)} "
                       f"(got {set_kinds or 'none'})", set_kinds)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            _fail(f"{param}.json", "a JSON schema (object or string)", self.json)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"{param}.{name}", "a non-empty string", value)
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            _fail(f"{param}.choice", "a non-empty list of non-empty strings", self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail(f"{param}.json_object", "a bool", self.json_object)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


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
    # Penalties (vLLM semantics, applied before temperature): presence / frequency count the
    # generated tokens only (OpenAI), repetition the prompt and the generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                _fail(name, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]", value)
        if (not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            _fail("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            _fail("structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)
        self.stop_strings = self._normalise_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "None or a list of integers >= 0", self.stop_token_ids)
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.is_greedy:
            # Upstream DeepInfer (its sampling_params.py): greedy resets top-p/top-k; min_p is moot
            # under argmax (vLLM resets it).
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            _fail("stop", "None, a non-empty string or a list of non-empty strings", stop)
        return list(items)

    @staticmethod
    def _normalise_logit_bias(bias) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            _fail("logit_bias", "None or a dict of token id -> bias", bias)
        out = {}
        for tid, b in bias.items():
            if not _is_int(tid) or tid < 0:
                _fail("logit_bias", "keyed by token ids (integers >= 0)", tid)
            if not _is_real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                _fail("logit_bias", f"valued in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", b)
            out[int(tid)] = float(b)
        return out or None

    @property
    def penalises_output(self) -> bool:
        """Presence or frequency penalty set: the sampler needs the generated token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def penalises_repetition(self) -> bool:
        """Repetition penalty set: the sampler needs the prompt and generated token ids."""
        return self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def greedy_raw_argmax(self) -> bool:
        """Greedy with no logit bias or penalty: the token is the raw logits' argmax, unless a ban or a
        grammar mask (per row, not in these parameters) takes it out."""
        return (self.is_greedy and not self.logit_bias and not self.penalises_output
                and not self.penalises_repetition)

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

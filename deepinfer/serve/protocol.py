"""Request bodies of the OpenAI API (pydantic, strict types) and their SamplingParams.

Unknown fields are accepted and ignored, as vLLM does (clients send vendor extras); wrong types
are 400s, not coerced ("16" is not an integer). Parameters we do not implement answer 501.
Chat `tools` / `tool_choice` are checked by serve/tool_choice.py.
"""

from __future__ import annotations

import json
import logging
from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from deepinfer.serve.errors import APIError, bad_request, not_implemented
from deepinfer.serve.structured_fields import structured_outputs_params
from deepinfer.serve.tool_choice import ToolSpec, tool_spec

logger = logging.getLogger(__name__)

MAX_N = 32  # completions per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 256  # n * prompts
MAX_STOP = 16  # stop strings
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias
    response_format: dict | None = None
    structured_outputs: dict | None = None  # vLLM's object; guided_* extras are read too
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be an integer in [1, {MAX_N}], got {self.n}", "n")
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
                              "temperature")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise bad_request(f"stop must have at most {MAX_STOP} strings, got {len(self.stop)}", "stop")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.logit_bias_ids()
        self.structured_outputs_params()
        if self.model_extra:
            logger.debug("ignored request fields: %s", sorted(self.model_extra))

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias keyed by int token ids; a key that is not a token id is a 400."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out[tid] = bias
        return out

    def structured_outputs_params(self):
        return structured_outputs_params(self.response_format, self.structured_outputs, self.model_extra)

    def sampling_params(self, max_tokens: int, logprobs: int | None, n: int | None = None) -> SamplingParams:
        """n: the number of sequences the engine generates (best_of), default the request's n."""
        try:
            return SamplingParams(
                n=self.n if n is None else n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.logit_bias_ids(), structured_outputs=self.structured_outputs_params())
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: best_of when set (completions), else n."""
        return max(self.n, getattr(self, "best_of", None) or self.n)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        # best_of 1 is OpenAI's default: clients send it with any n, so it means "not set".
        if self.best_of is not None and self.best_of != 1:
            if not self.n <= self.best_of <= MAX_N:
                raise bad_request(f"best_of must be in [n ({self.n}), {MAX_N}], got {self.best_of}",
                                  "best_of")
            if self.stream and self.best_of > self.n:
                raise bad_request("best_of > n cannot be streamed (the best are known only at the end)",
                                  "best_of")
        if self.suffix:
            raise not_implemented("suffix is not supported", "suffix")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad_request(f"max_tokens must be at least 0, got {self.max_tokens}", "max_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
        if self.max_tokens == 0 and self.min_tokens > 0:
            raise bad_request(f"min_tokens must be <= max_tokens (0), got {self.min_tokens}", "min_tokens")

    @property
    def scoring_only(self) -> bool:
        """echo + logprobs + max_tokens 0: score the prompt, generate nothing (evaluation harnesses)."""
        return self.echo and self.logprobs is not None and self.max_tokens == 0


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # {"thinking": bool}: DeepSeek V4 thinking mode

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must contain at least one message", "messages")
        self.tool_spec()
        for limit in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, limit)
            if value is not None and value < 1:
                raise bad_request(f"{limit} must be at least 1, got {value}", limit)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            # checked here: SamplingParams would name its own field (logprobs), not the chat one
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                              f"{self.top_logprobs}", "top_logprobs")

    def tool_spec(self) -> ToolSpec | None:
        spec = tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)
        if spec is not None and spec.forced and self.structured_outputs_params() is not None:
            raise bad_request(f"tool_choice {spec.choice} constrains the reply; it cannot be combined "
                              f"with a structured output constraint", "tool_choice")
        return spec

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking(self) -> bool:
        kwargs = self.chat_template_kwargs or {}
        value = kwargs.get("thinking", kwargs.get("enable_thinking", False))
        if not isinstance(value, bool):
            raise bad_request("chat_template_kwargs.thinking must be a bool", "chat_template_kwargs")
        return value


def parse_body(raw: bytes, model: type[BaseModel]):
    """Parse and validate a JSON body; any problem is a 400 naming the offending field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = first.get("loc", ())
    # A union reports one error per member; the field is what matters to the client.
    field = loc[0] if loc else None
    param = str(field) if field is not None else None
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param)
    names = ", ".join(sorted({str(err["loc"][0]) for err in errors if err.get("loc")}))
    return bad_request(f"invalid value for {names}: {first.get('msg')} (got {_short(first.get('input'))})",
                       param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


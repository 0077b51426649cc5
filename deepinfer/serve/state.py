"""Server-wide settings and the objects every route needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.serve.engine_loop import EngineLoop
from deepinfer.serve.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0  # seconds in-flight requests may finish after SIGTERM
    max_pending: int = 0  # engine requests in flight before new ones get 503; 0 = unlimited
    created: int = 0  # /v1/models timestamp
    # Splits thinking-mode replies into reasoning_content and content (serve/reasoning.py);
    # None: the raw text is the content.
    reasoning_parser: str | None = "deepseek_v4"

    def __post_init__(self):
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(f"served_model_name must be a non-empty string, got {self.served_model_name!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if self.reasoning_parser not in (None, "deepseek_v4"):
            raise ValueError(f"reasoning_parser must be deepseek_v4 or None, got {self.reasoning_parser!r}")
        if not isinstance(self.max_pending, int) or self.max_pending < 0:
            raise ValueError(f"max_pending must be an integer >= 0 (0 = unlimited), got {self.max_pending!r}")


@dataclass
class ServerState:
    config: ServerConfig
    engine_loop: EngineLoop
    extra: dict = field(default_factory=dict)

    @property
    def engine(self):
        return self.engine_loop.engine

    @property
    def tokenizer(self):
        return self.engine_loop.engine.tokenizer

    def require_tokenizer(self, what: str, param: str):
        """The tokenizer, or a 400 naming `param` when the engine runs without one
        (--skip-tokenizer-init: token-id prompts in, token ids out, no text)."""
        tok = self.tokenizer
        if tok is None:
            from deepinfer.serve.errors import bad_request
            raise bad_request(f"{what} needs a tokenizer, and this server runs with --skip-tokenizer-init; "
                              f"send the prompt as token ids", param)
        return tok

    @property
    def max_model_len(self) -> int:
        return int(self.engine_loop.engine.config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine_loop.engine.vocab_size)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_capacity(self, num_new: int) -> None:
        self.engine_loop.check_available()
        limit = self.config.max_pending
        if limit and self.engine_loop.num_pending + num_new > limit:
            raise APIError(503, f"the server is overloaded ({self.engine_loop.num_pending} requests "
                                f"in flight, limit {limit}); retry later")

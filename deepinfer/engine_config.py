"""EngineConfig: the engine's typed, validated knobs (vLLM names).

Model-dependent defaults (max_model_len) are resolved once the ModelConfig is known, through
`resolve(model_config)`; the worker fills in `block_size` / `num_kv_blocks` when they are None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("auto", "bfloat16", "float32")
_DEFAULT_MAX_MODEL_LEN = 4096
_FALLBACK_KV_CACHE_BYTES = 1 << 30


def _default_kv_cache_memory_bytes() -> int:
    # Env vars are read only in deepinfer/envs.py (DEEPINFER_KV_CACHE_MEMORY_BYTES).
    try:
        from deepinfer import envs
        return int(envs.DEEPINFER_KV_CACHE_MEMORY_BYTES)
    except (ImportError, AttributeError):
        return _FALLBACK_KV_CACHE_BYTES


def _check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if allow_none:
            allowed += " or None"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # None -> same path as model
    dtype: str = "auto"  # "auto" -> the checkpoint's compute dtype
    max_model_len: int | None = None  # None -> min(max_position_embeddings, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # None -> sized by the worker from kv_cache_memory_bytes
    block_size: int | None = None  # token positions per KV block; None -> worker's choice
    enforce_eager: bool = False
    # Compile (Neuron) or capture (CUDA) every bucket's graph when the engine starts instead of on a
    # bucket's first step, so no request waits for a compile.
    warmup_graphs: bool = False
    seed: int = 0
    # No tokenizer: prompts must be token ids and outputs carry no text (vLLM's name).
    skip_tokenizer_init: bool = False
    kv_cache_memory_bytes: int = field(default_factory=_default_kv_cache_memory_bytes)
    # "plain": cache values in the compute dtype; "compact": DeepSeek's records (fp8 e4m3 SWA with
    # ue8m0 scales, fp4 compressed entries and index keys), dequantized when read.
    kv_cache_mode: str = "plain"

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path string, got {self.model!r}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer must be a non-empty path string or None, got {self.tokenizer!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _check_int("max_model_len", self.max_model_len, 2, allow_none=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        # Every running sequence decodes each step, so one step must hold a token for each of them.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}")
        # Block 0 is the reserved scratch block, so a usable pool has at least two.
        _check_int("num_kv_blocks", self.num_kv_blocks, 2, allow_none=True)
        _check_int("block_size", self.block_size, 1, allow_none=True)
        for name in ("enforce_eager", "warmup_graphs", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("seed", self.seed, 0, (1 << 63) - 1)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.kv_cache_mode not in ("plain", "compact"):
            raise ValueError(f"kv_cache_mode must be 'plain' or 'compact', got {self.kv_cache_mode!r}")

    def resolve(self, model_config) -> EngineConfig:
        """Fill model-dependent defaults and check them against the model; returns self."""
        max_pos = int(model_config.max_position_embeddings)
        if self.max_model_len is None:
            self.max_model_len = min(max_pos, _DEFAULT_MAX_MODEL_LEN)
        elif self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len must be in [2, {max_pos}] (the model's max_position_embeddings), "
                f"got {self.max_model_len}")
        return self

"""ModelConfig: the checkpoint's config.json, normalized and validated (docs/model.md §1); the two
dialects are parsed by config/v4.py and config/v41.py into the same fields."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from deepinfer.config.fields import V4, V41, fail
from deepinfer.config.v4 import parse_v4
from deepinfer.config.v41 import parse_v41, validate_v41


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_experts_per_tok: int
    n_shared_experts: int
    moe_inter_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    norm_topk_prob: bool
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    torch_dtype: torch.dtype
    compress_ratios: list[int]
    layer_kinds: list[str]
    hash_moe: list[bool]
    hc_shifted: bool
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # V4.1 only (empty / None for V4)
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    index_k_source_layer_ids: list[int] = field(default_factory=list)
    kv_source_map: list[int] = field(default_factory=list)
    index_source_map: list[int] = field(default_factory=list)
    index_k_source_map: list[int] = field(default_factory=list)
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    use_fp4_sparse_kv: bool = False
    n_prefill_layer: int = 0
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab: bool = False
    engram_pad_token_id: int | None = None
    dspark_block_size: int | None = None
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    quant: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path/config.json` (or `path` itself if it is a file)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(path):
            raise ValueError(f"config.json not found: the model directory {path!r} does not exist")
        if not os.path.isfile(file):
            raise ValueError(f"config.json not found at {file}")
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"config: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == V4:
            cfg = cls(**parse_v4(raw))
        elif model_type == V41:
            cfg = cls(**parse_v41(raw))
        else:
            fail("model_type", f"must be {V4!r} or {V41!r}, got {model_type!r}")
        cfg.raw = raw
        validate_common(cfg)
        if cfg.is_v41:
            validate_v41(cfg)
        return cfg


def validate_common(c: ModelConfig) -> None:
    p = "text_config." if c.is_v41 else ""
    if c.num_heads % c.o_groups:
        fail(p + "o_groups", f"must divide num_attention_heads {c.num_heads}, got {c.o_groups}")
    if c.rope_dim % 2 or c.rope_dim > c.head_dim or c.rope_dim > c.index_head_dim or c.rope_dim <= 0:
        fail(p + "qk_rope_head_dim", f"must be even and in [2, min(head_dim, index_head_dim) = "
                                      f"{min(c.head_dim, c.index_head_dim)}], got {c.rope_dim}")
    if c.n_experts_per_tok > c.n_routed_experts:
        fail(p + "num_experts_per_tok", f"must be <= n_routed_experts {c.n_routed_experts}, "
                                         f"got {c.n_experts_per_tok}")
    for key, ids in (("engram_layer_ids", c.engram_layer_ids), ("dspark_target_layer_ids", c.dspark_target_layer_ids)):
        for s in ids:
            if not 0 <= s < c.num_layers:
                fail(p + key, f"entries must be in [0, {c.num_layers - 1}], got {s}")
    for key, tok in (("bos_token_id", c.bos_token_id), ("pad_token_id", c.pad_token_id)):
        if tok is not None and tok >= c.vocab_size:
            fail(key, f"must be < vocab_size {c.vocab_size}, got {tok}")
    for tok in c.eos_token_ids:
        if tok >= c.vocab_size:
            fail("eos_token_id", f"must be < vocab_size {c.vocab_size}, got {tok}")

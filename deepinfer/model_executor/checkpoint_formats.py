"""How the released checkpoint stores each tensor (docs/model.md §2.1), declared by the module that
owns the tensor, and the few name rules the loader and the shard plan apply to names alone.

Formats:
- F32: fp32 whatever the compute dtype. Every tensor the model holds in fp32 while built at a lower
  compute dtype (HC fn/base/scale, attn_sink, ffn.gate.bias / bias_vl), and what a module declares
  so although it computes in the model dtype (the V4 compressor `ape`: TF keeps `position_bias` fp32).
- FP8: e4m3 + `X.scale` ue8m0 blocks (the config's weight_block_size): the linears upstream
  DeepInfer builds with use_fp8_gemm (attention wq_a / wq_b / wkv / wo_a / wo_b, indexer wq_b,
  shared experts, Engram wkv, DSpark main_proj).
- FP4: routed experts, packed e2m1 pairs [out, in/2] + one ue8m0 scale per 32 inputs.
- TABLE: the Engram table, e4m3 rows + one ue8m0 scale per 32 values of a row.
- INT: integer tables (V4 hash routing `ffn.gate.tid2eid`).
- BF16: everything else (embed, head, norms, router gate, compressor wkv / wgate, indexer
  weights_proj / wk, Engram q / k weights, the DSpark Markov and confidence heads).
A checkpoint without quantization_config stores every BF16 / FP8 / FP4 / TABLE tensor DENSE, in the
config dtype. model_executor/checkpoint_schema.py reads the declarations off the meta-built model.
"""
from __future__ import annotations

import re

from torch import nn

F32, BF16, FP8, FP4, TABLE, INT, DENSE = "f32", "bf16", "fp8", "fp4", "table", "int", "dense"
QUANTIZED = (FP8, FP4, TABLE)   # what an unquantized checkpoint stores DENSE, with BF16

_DECLARED = "checkpoint_formats"   # the module attribute: leaf name -> format


def stored_as(fmt: str, module: nn.Module, *leaves: str) -> nn.Module:
    """Declare how the checkpoint stores `module`'s own tensors `leaves` (default its `weight`);
    returns the module, so a constructor can write `self.wq_a = stored_as(FP8, linear(...))`."""
    if fmt not in (F32, BF16, FP8, FP4, TABLE, INT):
        raise ValueError(f"stored_as: unknown checkpoint format {fmt!r}")
    declared = dict(getattr(module, _DECLARED, {}))
    declared.update({leaf: fmt for leaf in leaves or ("weight",)})
    setattr(module, _DECLARED, declared)
    return module


def declared_format(module: nn.Module, leaf: str) -> str | None:
    return getattr(module, _DECLARED, {}).get(leaf)


def unquantized(fmt: str) -> str:
    """The format of the same tensor in a checkpoint without quantization_config."""
    return DENSE if fmt in QUANTIZED or fmt == BF16 else fmt


# ---------------------------------------------------------------------------------------------
# name rules for code that sees names without a model (the loader, the shard plan)
# ---------------------------------------------------------------------------------------------

# `layers.{i}.ffn.experts.{e}.{leaf}` / `mtp.{i}.ffn.experts.{e}.{leaf}`: (block, expert id, rest)
_ROUTED_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.(\d+)\.(.+)$")
ENGRAM_TABLE = "engram.embed.weight"


def routed_expert(name: str) -> tuple[str, int, str] | None:
    """(block prefix, expert id, leaf path) of a routed expert's tensor, None for any other name."""
    m = _ROUTED_EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def is_engram_table(name: str) -> bool:
    return name.endswith(ENGRAM_TABLE)


def is_fp32_tensor(name: str) -> bool:
    """Tensors the model holds in fp32 whatever the compute dtype (docs/model.md §2.1); the loader
    keeps them fp32 when it casts to a requested dtype. tests/unit/test_checkpoint_schema.py checks this
    rule against the F32 tensors of the meta-built models."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf.startswith("hc_") and leaf.endswith(("_fn", "_base", "_scale"))) or leaf == "attn_sink" \
        or name.endswith(("ffn.gate.bias", "ffn.gate.bias_vl"))

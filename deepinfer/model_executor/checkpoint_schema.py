"""The checkpoint's tensors for a model config (docs/model.md §2.2): every canonical name with its
dense shape, the dtype the model holds it in and the format the checkpoint stores it in
(model_executor/checkpoint_formats.py), all read off `DeepseekV4Model` built on the meta device, so
the model's modules are the one definition of the layout.

The model's state_dict names are the canonical names (models/deepseek_v4.py), built with dense
weights and no parallel layout (the whole model, one rank). Its dtypes at a bfloat16 compute dtype
tell the loader's classes apart: float32 (the §2.1 fp32 tensors), int64 (tid2eid) and the compute
dtype for the rest. The tiny checkpoint writer, the memory report and the dry run read this; the
loader checks a checkpoint against the model's own state_dict, which is the same list.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from deepinfer.model_executor.checkpoint_formats import BF16, F32, INT, declared_format, unquantized

_PROBE_DTYPE = torch.bfloat16   # a compute dtype below fp32, so the model's fp32 tensors stand out


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    dtype: torch.dtype   # float32, an integer dtype, or _PROBE_DTYPE for "the compute dtype"
    stored: str          # checkpoint_formats format in a quantized checkpoint

    @property
    def compute_dtype(self) -> bool:
        return self.dtype == _PROBE_DTYPE


@contextlib.contextmanager
def no_weight_init():
    """Meta tensors hold no values, so nn.Linear / nn.Embedding random init is pure overhead
    (about 10 s of dispatch for the 48k linears of V4.1-Flash); make those init calls no-ops."""
    def keep(t, *args, **kwargs):
        return t
    with mock.patch.object(nn.init, "kaiming_uniform_", keep), mock.patch.object(nn.init, "uniform_", keep), \
            mock.patch.object(nn.init, "normal_", keep):
        yield


def _owner_format(model: nn.Module, name: str, t: torch.Tensor) -> str:
    path, _, leaf = name.rpartition(".")
    fmt = declared_format(model.get_submodule(path) if path else model, leaf)
    if fmt is not None:
        return fmt
    if not t.dtype.is_floating_point:
        return INT
    return F32 if t.dtype == torch.float32 else BF16


def _derive(cfg) -> dict[str, TensorSpec]:
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    with torch.device("meta"), no_weight_init():
        model = DeepseekV4Model(cfg, _PROBE_DTYPE)
    return {name: TensorSpec(tuple(t.shape), t.dtype, _owner_format(model, name, t))
            for name, t in model.state_dict(keep_vars=True).items()}


_CACHE: dict[str, dict[str, TensorSpec]] = {}
_CACHE_SIZE = 8   # a meta build of V4.1-Flash takes seconds; reports ask for the same config repeatedly


def _cached(cfg) -> dict[str, TensorSpec]:
    # The cached dict itself, for this module's per-tensor lookups: a full-size config has ~10^5
    # tensors, and copying the schema on every lookup made a report loop quadratic.
    key = repr(cfg)   # every field of the config (ModelConfig is a dataclass; its raw dict is not repr'd)
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _derive(cfg)
    return _CACHE[key]


def checkpoint_schema(cfg) -> dict[str, TensorSpec]:
    """Canonical name -> TensorSpec, in the model's state_dict order (a copy: callers may edit it)."""
    return dict(_cached(cfg))


def tensor_shapes(cfg) -> dict[str, tuple]:
    """Canonical name -> dense shape."""
    return {name: spec.shape for name, spec in _cached(cfg).items()}


def tensor_format(cfg, name: str, quantized: bool = True) -> str:
    """How a checkpoint stores a canonical tensor (checkpoint_formats): quantized, the release
    format; else DENSE for everything but the fp32 and integer tensors."""
    fmt = _cached(cfg)[name].stored
    return fmt if quantized else unquantized(fmt)


def expected_tensor_specs(cfg, dtype: torch.dtype | None = None) -> dict[str, tuple[tuple, torch.dtype]]:
    """Canonical name -> (dense shape, dtype the loader returns): fp32 for the §2.1 fp32 tensors,
    int64 for tid2eid, else `dtype` (default cfg.torch_dtype); `load_weights` takes it as `expected`."""
    dtype = dtype or cfg.torch_dtype
    return {name: (spec.shape, dtype if spec.compute_dtype else spec.dtype)
            for name, spec in _cached(cfg).items()}


def count_parameters(cfg, include_buffers: bool = True) -> int:
    """Dense element count of every float tensor (tid2eid is an index table, never counted).
    include_buffers=False also drops ffn.gate.bias, which TF holds as a buffer: that count is TF's
    `num_parameters` (73,432,545 for the V4 tiny model)."""
    return sum(math.prod(spec.shape) for name, spec in _cached(cfg).items()
               if spec.dtype.is_floating_point and (include_buffers or not name.endswith("ffn.gate.bias")))


def engram_table_primes(cfg) -> dict[int, list[list[int]]]:
    """layer -> [n-gram order 2..N] -> [head] -> table size (docs/model.md §3.7), as the model's hash
    layout computes them (layers/engram_hash.py)."""
    from deepinfer.model_executor.layers.engram_hash import compute_primes
    primes = compute_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                            cfg.engram_vocab_size)
    return {layer: [list(per_head) for per_head in per_n] for layer, per_n in primes.items()}


def engram_table_rows(cfg) -> dict[int, int]:
    """layer -> rows of its Engram table (the sum of its primes)."""
    return {layer: sum(sum(s) for s in per_n) for layer, per_n in engram_table_primes(cfg).items()}

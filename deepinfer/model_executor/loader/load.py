"""The loader's entry points: `load_weights` (a checkpoint -> {canonical name: tensor} for an
expected list) and `load_checkpoint` (fill a model from its own state_dict names)."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from tqdm import tqdm

from deepinfer.model_executor.checkpoint_formats import is_fp32_tensor
from deepinfer.model_executor.loader.decode import decode, raw_codes
from deepinfer.model_executor.loader.formats import check_shape
from deepinfer.model_executor.loader.names import canonical_names
from deepinfer.model_executor.loader.plan import expected_spec, plan_items
from deepinfer.model_executor.loader.scan import block_hint, open_safetensors, scan


def load_weights(model_dir: str | Path, expected: Mapping[str, Any], dtype: torch.dtype | None = None,
                 progress: bool = True, plan=None, skip=(), partial: bool = False) -> dict[str, torch.Tensor]:
    """Read, rename and dequantize a checkpoint into {canonical name: dense tensor}.

    expected: canonical name -> anything with `.shape` and `.dtype` (a tensor, a meta tensor, or a
    `(shape, dtype)` tuple such as `checkpoint_schema.expected_tensor_specs(cfg)`).
    dtype: output dtype of float tensors; the fp32 tensors of docs/model.md §2.1 stay fp32. None keeps
    each expected tensor's own dtype. Integer tensors (tid2eid) take the expected dtype.
    plan: a rank's ShardPlan: only its slices and experts are read (get_slice), never a whole sharded
    tensor; `expected` then lists the rank's own shapes (its model's state_dict).
    skip: canonical names the checkpoint stores that are not read (e.g. Engram tables mapped from
    shared memory, distributed/shared_tables.py); partial: load only `expected`, whatever else is stored.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} is not a directory")
    specs = {name: expected_spec(v) for name, v in expected.items()}
    names, _ = canonical_names(scan(model_dir))
    hint = block_hint(model_dir)
    items = plan_items(names, specs, hint, plan, frozenset(skip), partial)

    out: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    bar = tqdm(total=len(specs), desc="Loading weights", unit="tensor", disable=not progress)
    try:
        for item in items:
            for st in (item.src, item.scale):
                if st is not None and st.file not in handles:
                    handles[st.file] = open_safetensors(model_dir / st.file)
            f_scale = handles[item.scale.file] if item.scale else None
            if item.raw:
                codes, exps = raw_codes(item, handles[item.src.file], f_scale, hint)
                for name, cut in item.outputs:
                    out[name] = cut(codes).contiguous()
                    bar.update(1)
                for name, cut in item.scale_outputs:
                    out[name] = cut(exps).contiguous()
                    check_shape(name, tuple(out[name].shape), specs[name][0], torch.uint8, item.scale)
                    bar.update(1)
                continue
            dense = decode(item, handles[item.src.file], f_scale, hint)
            for name, cut in item.outputs:
                exp_dtype = specs[name][1]
                if not exp_dtype.is_floating_point:
                    target = exp_dtype
                elif dtype is None:
                    target = exp_dtype
                else:
                    target = torch.float32 if is_fp32_tensor(name) else dtype
                out[name] = cut(dense).to(target).contiguous()
                bar.update(1)
    finally:
        bar.close()
        handles.clear()
    return out


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype | None = None,
                    progress: bool = True, skip=()) -> dict[str, float]:
    """Fill `model` (its state_dict names are the canonical names) from `model_dir`.

    Each tensor takes the model's own dtype unless `dtype` is given (then §2.1 fp32 tensors stay fp32).
    Meta-device models are materialized by assignment. Calls `model.post_load()` afterwards if the model
    has one (e.g. to stack expert weights). Returns {"tensors", "elements", "seconds"}.
    skip: state_dict names left as the model holds them (and not read from the checkpoint).
    """
    started = time.perf_counter()
    skip = frozenset(skip)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in skip}
    plan = getattr(model, "shard_plan", None)
    weights = load_weights(model_dir, expected, dtype=dtype, progress=progress,
                           plan=plan if plan is not None and plan.sharded else None, skip=skip)
    on_meta = any(t.is_meta for t in expected.values())
    with torch.no_grad():
        result = model.load_state_dict(weights, strict=not skip, assign=on_meta or dtype is not None)
    if skip and (set(result.missing_keys) != skip or result.unexpected_keys):
        raise ValueError(f"load_checkpoint: skip names {sorted(skip - set(result.missing_keys))} are not "
                         f"tensors of the model")
    if hasattr(model, "post_load"):
        model.post_load()
    return {"tensors": len(weights), "elements": sum(math.prod(t.shape) for t in weights.values()),
            "seconds": time.perf_counter() - started}

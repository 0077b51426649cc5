"""The load plan: every expected tensor matched to the stored tensor (and scale) it is cut from,
with its format, its shape checked, the cut (stacked transformers experts, Engram rows) and, for a
rank of a split model, the slice or experts it reads. Nothing is read until the whole plan checks;
missing and unexpected tensors are reported together."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from deepinfer.model_executor.checkpoint_formats import is_engram_table, routed_expert
from deepinfer.model_executor.loader.formats import (check_shape, dense_of_packed, dense_shape, engram_rows,
                                                     storage_kind)
from deepinfer.model_executor.loader.names import bind_scales
from deepinfer.model_executor.loader.scan import Stored, dtype_name

# (docs/model.md §2.2, §8 item 5), as are the tied mtp embed/head copies.
_MTP_OPTIONAL = re.compile(r"^mtp\.\d+\.(main_proj\.|main_norm\.|markov_head\.|confidence_head\.|norm\.|hc_head_|"
                           r"embed\.weight$|head\.weight$)")
_EXPERT_LEAVES = ("w1.weight", "w2.weight", "w3.weight")   # the per-expert names a stacked TF tensor splits into


@dataclass
class Item:
    """One stored tensor (plus scale) and the canonical outputs cut from its value: the dense value,
    or (raw) its stored codes, with the same cut applied to the scale for `scale_outputs`."""
    src: Stored
    scale: Stored | None
    fmt: str  # dense | int | fp8 | fp4
    outputs: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    raw: bool = False
    scale_outputs: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)
    cuts: tuple = ()        # shard_plan.Cut (dense coordinates) this rank reads (attention lanes)
    experts: range | None = None  # stacked experts: the expert rows this rank reads (expert parallelism)


def expected_spec(value: Any) -> tuple[tuple, torch.dtype]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
        return tuple(value[0]), value[1]
    return tuple(value.shape), value.dtype


def plan_items(names: dict[str, Stored], expected: dict[str, tuple[tuple, torch.dtype]], hint, plan=None,
          skip: frozenset = frozenset(), partial: bool = False) -> list[Item]:
    """plan: a rank's ShardPlan (model_executor/shard_plan.py): `expected` then holds its slices' shapes
    and only its experts; the checkpoint's full shapes are checked against the plan's full sizes.
    skip: stored tensors not to load (the caller fills them); partial: `expected` is a subset, so the
    checkpoint's other tensors are not errors."""
    tensors, scales = bind_scales(names)

    items: list[Item] = []
    used: set[str] = set()
    stacked: dict[str, Item] = {}
    missing = []
    # packed weights: `X.scale` is an output of the `X.weight` item, not a tensor of its own
    packed_scales = {n for n in expected if n.endswith(".scale") and expected.get(n[: -len(".scale")] + ".weight",
                                                                               (None, None))[1] == torch.uint8}
    for name, (exp_shape, exp_dtype) in expected.items():
        if name in packed_scales:
            continue
        raw = exp_dtype == torch.uint8
        st = tensors.get(name)
        if st is not None:
            used.add(name)
            sc = scales.get(name)
            kind = storage_kind(name, st, sc, exp_dtype)
            found = dense_shape(name, st, sc, kind, hint)
            dense_exp = dense_of_packed(exp_shape, kind) if raw else exp_shape
            cuts = plan.cuts(name) if plan is not None else ()
            if cuts:   # the checkpoint holds the full tensor: check it against the full sizes
                if kind == "fp4":
                    raise ValueError(f"tensor {name!r}: no sliced form of a packed fp4 weight")
                full = {c.dim: c.full for c in cuts}
                dense_exp = tuple(full.get(d, n) for d, n in enumerate(dense_exp))
            if is_engram_table(name):
                fix = engram_rows(name, found, dense_exp, exp_dtype, st)
            else:
                check_shape(name, found, dense_exp, exp_dtype, st)
                fix = identity
            item = Item(st, sc, kind, [(name, fix)], raw=raw, cuts=cuts)
            if raw:
                item.scale_outputs.append((name[: -len(".weight")] + ".scale", fix))
            items.append(item)
            continue
        expert_of = routed_expert(name)
        key = None
        if expert_of is not None and expert_of[2] in _EXPERT_LEAVES:
            block, expert, which = expert_of[0], expert_of[1], expert_of[2][: -len(".weight")]
            key = f"{block}.ffn.experts.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
        if key is None or key not in tensors:
            missing.append(f"{name!r} (shape {tuple(exp_shape)} dtype {dtype_name(exp_dtype)})")
            continue
        used.add(key)
        item = stacked.get(key)
        st, sc = tensors[key], scales.get(key)
        if item is None:
            held = plan.moe_experts(name) if plan is not None else None
            item = Item(st, sc, storage_kind(key, st, sc, exp_dtype), raw=raw, experts=held)
            stacked[key] = item
            items.append(item)
        found = dense_shape(key, st, sc, item.fmt, hint)
        row = expert - (item.experts.start if item.experts is not None else 0)   # in the rows read
        if raw:
            exp_shape = dense_of_packed(exp_shape, item.fmt)
        rows = exp_shape[0]
        want = (expert + 1, 2 * rows, exp_shape[1]) if which != "w2" else (expert + 1, *exp_shape)
        if len(found) != 3 or found[0] < want[0] or tuple(found[1:]) != tuple(want[1:]):
            raise ValueError(f"tensor {name!r}: expected shape {tuple(exp_shape)} dtype {dtype_name(exp_dtype)} "
                             f"(from stacked {key!r} [E>{expert}, {want[1]}, {want[2]}]), found {st.describe()}")
        if which == "w1":
            cut = lambda t, e=row, r=rows: t[e, :r]  # noqa: E731
        elif which == "w3":
            cut = lambda t, e=row, r=rows: t[e, r:]  # noqa: E731
        else:
            cut = lambda t, e=row: t[e]  # noqa: E731
        item.outputs.append((name, cut))
        if raw:
            if item.fmt != "fp4":   # a row cut of an fp8 block grid would split blocks
                raise ValueError(f"tensor {name!r}: stacked fp8 experts cannot be kept packed; use "
                                 f"weight_format='dense'")
            item.scale_outputs.append((name[: -len(".weight")] + ".scale", cut))
    if missing:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}{more}")

    for key, item in stacked.items():
        n_experts = item.src.shape[0]
        got = {routed_expert(n)[1] for n, _ in item.outputs}
        if item.experts is not None:   # a rank of an EP group: the file holds every expert, we read ours
            if n_experts != plan.moe_size(key) or got != set(item.experts):
                raise ValueError(f"tensor {key!r}: stacked {n_experts} experts, the model has "
                                 f"{plan.moe_size(key)} (this rank reads {item.experts}); found {item.src.describe()}")
            continue
        if len(got) != n_experts:
            raise ValueError(f"tensor {key!r}: stacked {n_experts} experts but the model expects {len(got)}; "
                             f"found {item.src.describe()}")

    has_mtp = any(n.startswith("mtp.") for n in expected)
    extra = []
    for name, st in tensors.items():
        if name in used or name in skip or partial:
            continue
        if name.startswith("mtp.") and (not has_mtp or _MTP_OPTIONAL.match(name)):
            continue  # drafting tensors the model does not build (V4 MTP; DSpark head copies)
        if plan is not None and not plan.holds(name):
            continue  # another EP rank's expert
        extra.append(f"{name!r} ({st.describe()})")
    if extra:
        more = f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""
        raise ValueError(f"checkpoint has {len(extra)} unexpected tensor(s): {', '.join(extra[:10])}{more}")
    return items


def identity(t: torch.Tensor) -> torch.Tensor:
    return t

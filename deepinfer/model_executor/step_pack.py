"""A step's metadata as one host->device copy (docs/neuron.md §4 D3: every copy drains the stream).

`pack(step)` lays every tensor of a StepInputs (its CompressMeta and prefix copies included) end to end
in one int64 buffer, bool masks as 0 / 1, and describes where each sits in a `StepLayout`: a nested
tuple of Python constants, so a compiled region that takes it guards on its value (same layout, same
graph). `unpack(buf, layout)` rebuilds the StepInputs from slices of the copied buffer; it runs inside
the first compiled region of a step (worker/runners/neuron_regions.py), so the slicing and the mask
comparisons are graph ops, not eager launches. `rebuild(layout, leaves)` puts tensors the region returned
back into the same structure (pure Python). Integer and bool metadata packs as values: every one is a
row index, position or length, all inside the int32 range a device narrows int64 to (§4 A4). The
Engram rows the host gathered (StepInputs.engram_rows, layers/engram_host.py) are the one float
tensor: they pack as their bit patterns (an fp32 as its int32, a bf16 / fp16 as its int16, also inside
the int32 range), and the region reinterprets them, so they ride the same single copy.
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.model_executor.forward_meta import CompressMeta, StepInputs
from deepinfer.model_executor.prefix_state import PrefixStateIO, StateCopies

_CLASSES = {c.__name__: c for c in (StepInputs, CompressMeta, PrefixStateIO, StateCopies)}
_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# float dtype -> the integer of its width that carries its bits (no float8: §4 A9)
_FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# StepLayout nodes: ("t", offset, numel, shape, is_bool) | ("f", offset, numel, shape, float dtype) |
# ("v", python value) |
# ("d", ((key, node), ...)) a dict | ("c", class name, ((field, node), ...)) a dataclass


def pack(step: StepInputs) -> tuple[torch.Tensor, tuple]:
    """(int64 buffer [n], StepLayout) of a host-built step."""
    parts: list[torch.Tensor] = []
    offset = [0]

    def walk(v, path: str):
        if isinstance(v, torch.Tensor):
            if v.is_meta:   # rows of a shape-only model's tables (the full-scale reports): no values, same size
                v = torch.zeros(v.shape, dtype=v.dtype)
            if v.dtype in _FLOAT_BITS:
                flat = v.reshape(-1).view(_FLOAT_BITS[v.dtype]).to(torch.int64)
                node = ("f", offset[0], flat.numel(), tuple(v.shape), v.dtype)
            elif v.dtype == torch.bool or v.dtype in _INTEGER:
                flat = v.reshape(-1).to(torch.int64)
                node = ("t", offset[0], flat.numel(), tuple(v.shape), v.dtype == torch.bool)
            else:
                raise TypeError(f"step_pack: {path} is {v.dtype}; only integer, bool and 16/32-bit float "
                                "step inputs pack")
            parts.append(flat)
            offset[0] += flat.numel()
            return node
        if dataclasses.is_dataclass(v) and type(v).__name__ in _CLASSES:
            return ("c", type(v).__name__, tuple((f.name, walk(getattr(v, f.name), f"{path}.{f.name}"))
                                                 for f in dataclasses.fields(v)))
        if isinstance(v, dict):
            return ("d", tuple((k, walk(x, f"{path}[{k!r}]")) for k, x in v.items()))
        return ("v", v)

    layout = walk(step, "step")
    buf = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return buf, layout


def _build(layout: tuple, tensor_of):
    """The structure of `layout`, each tensor node ("t" / "f") replaced by tensor_of(node)."""
    def build(node):
        tag = node[0]
        if tag in ("t", "f"):
            return tensor_of(node)
        if tag == "c":
            return _CLASSES[node[1]](**{name: build(sub) for name, sub in node[2]})
        if tag == "d":
            return {k: build(sub) for k, sub in node[1]}
        return node[1]
    return build(layout)


def unpack(buf: torch.Tensor, layout: tuple) -> StepInputs:
    """The StepInputs of `layout` from slices of `buf` (graph-traceable: slices, views, comparisons)."""
    def tensor_of(node):
        tag, off, n, shape, kind = node
        if tag == "f":   # kind: the float dtype whose bits the slice carries
            return buf[off:off + n].to(_FLOAT_BITS[kind]).view(kind).view(shape)
        t = buf[off:off + n].view(shape)
        return t != 0 if kind else t   # kind: is_bool
    return _build(layout, tensor_of)


def leaves(step: StepInputs) -> list[torch.Tensor]:
    """The step's tensors in layout order (what `rebuild` takes back)."""
    out: list[torch.Tensor] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif dataclasses.is_dataclass(v) and type(v).__name__ in _CLASSES:
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(step)
    return out


def rebuild(layout: tuple, tensors) -> StepInputs:
    """The StepInputs of `layout` holding `tensors` (in `leaves` order)."""
    it = iter(tensors)
    return _build(layout, lambda node: next(it))

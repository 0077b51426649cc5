"""One step's inputs as bytes: what the driver publishes and every follower decodes (docs/neuron.md §5.7).

A message is a small header, a JSON description, then the raw bytes of every tensor:

    "DIST" | kind u32 | json length u32 | json | tensor bytes (each 8-byte aligned)

The JSON holds the message's fields (kind STEP, DRAFT, DRAFT_GREEDY, GREEDY_SPEC or SHUTDOWN, the
logits rows every group pads to for the gather) and, per data-parallel group, its bucket, its real
logits rows, its StepInputs and (GREEDY_SPEC) its plan rows as a tree: dataclasses (StepInputs,
CompressMeta) by name, dicts with tuple keys (the compressor metadata is keyed by (ratio, ring,
overlap)), tensors as [dtype, shape, offset, nbytes], plain values as is.
The tree is walked generically, so a field added to StepInputs travels without a change here.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass, field

import torch

from deepinfer.model_executor.forward_meta import CompressMeta, StepInputs
from deepinfer.model_executor.prefix_state import PrefixStateIO, StateCopies
from deepinfer.model_executor.static_step import Bucket

MAGIC = b"DIST"
_HEAD = struct.Struct("<4sII")
KIND_STEP, KIND_SHUTDOWN = 1, 2
# A DSpark draft block (spec/proposer.py): every rank runs the draft layers too, because their MoE
# and lane attention have collectives; its StepInputs travel like a step's (bucket None, eager).
KIND_DRAFT = 3
# A greedy speculative step as one device program (spec/greedy_step.py): the verification step's
# StepInputs and, per group, its GreedySpecPlan rows (`plan`); every rank runs the forward and the
# verify_draft region (the draft block's MoE and lane attention have collectives too).
KIND_GREEDY_SPEC = 4
# A draft block whose rows all draft by argmax, the heads in its program (ModelRunner.draft_greedy):
# the same StepInputs as KIND_DRAFT; one row of drafts and confidences a sequence comes back.
KIND_DRAFT_GREEDY = 5
_CLASSES = {"StepInputs": StepInputs, "CompressMeta": CompressMeta, "PrefixStateIO": PrefixStateIO,
            "StateCopies": StateCopies}
_ALIGN = 8


@dataclass
class GroupStep:
    """One data-parallel group's share of a step, as every rank of that group runs it."""
    step: StepInputs          # host tensors
    bucket: Bucket | None
    num_logits: int           # real logits rows of this group (the first rows of its logits)
    plan: torch.Tensor | None = None  # KIND_GREEDY_SPEC: the group's GreedySpecPlan.meta rows (int64)


@dataclass
class StepMessage:
    kind: int = KIND_STEP
    groups: list[GroupStep] = field(default_factory=list)
    gather_rows: int = 0      # logits rows each group leader contributes to the gather (the max)
    head: list | None = None  # per group: its rows' layers/vocab_parallel.HeadPlan as JSON (None: whole rows)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"step message: unknown dtype {name!r}")
    return value


class _Writer:
    def __init__(self):
        self.views: list[tuple[int, memoryview]] = []
        self.size = 0

    def tensor(self, t: torch.Tensor) -> list:
        if t.device.type != "cpu":
            raise ValueError("step message: tensors must be host tensors (publish before the copy to the device)")
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        offset = -(-self.size // _ALIGN) * _ALIGN
        if nbytes:
            self.views.append((offset, memoryview(t.reshape(-1).view(torch.uint8).numpy())))
        self.size = offset + nbytes
        return [str(t.dtype), list(t.shape), offset, nbytes]

    def tree(self, value):
        if isinstance(value, torch.Tensor):
            return {"t": self.tensor(value)}
        if dataclasses.is_dataclass(value) and type(value).__name__ in _CLASSES:
            return {"dc": type(value).__name__,
                    "f": {f.name: self.tree(getattr(value, f.name)) for f in dataclasses.fields(value)}}
        if isinstance(value, dict):
            return {"d": [[list(k) if isinstance(k, tuple) else k, self.tree(v)] for k, v in value.items()]}
        if isinstance(value, tuple):   # e.g. StepInputs.seq_scopes, ((start, end), ...)
            return {"tp": [self.tree(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise TypeError(f"step message: cannot encode {type(value).__name__}")


def encode(msg: StepMessage) -> tuple[int, list[tuple[int, memoryview]]]:
    """(total size, [(offset, bytes)]) of the message: the parts a ring copies into its slot."""
    w = _Writer()
    groups = [{"bucket": None if g.bucket is None else dataclasses.astuple(g.bucket),
               "num_logits": int(g.num_logits), "step": w.tree(g.step), "plan": w.tree(g.plan)}
              for g in msg.groups]
    desc = json.dumps({"gather_rows": int(msg.gather_rows), "groups": groups, "head": msg.head},
                      separators=(",", ":")).encode()
    base = -(-(_HEAD.size + len(desc)) // _ALIGN) * _ALIGN
    parts = [(0, memoryview(_HEAD.pack(MAGIC, msg.kind, len(desc)))), (_HEAD.size, memoryview(desc))]
    parts += [(base + off, view) for off, view in w.views]
    return base + w.size, parts


def to_bytes(msg: StepMessage) -> bytearray:
    size, parts = encode(msg)
    out = bytearray(size)
    for off, view in parts:
        out[off:off + len(view)] = view
    return out


def _read_tree(node, buf: bytearray, base: int):
    if "t" in node:
        dtype_name, shape, offset, nbytes = node["t"]
        dtype = _dtype(dtype_name)
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=base + offset)
        return raw.view(dtype).reshape(shape)
    if "dc" in node:
        cls = _CLASSES[node["dc"]]
        return cls(**{k: _read_tree(v, buf, base) for k, v in node["f"].items()})
    if "d" in node:
        return {tuple(k) if isinstance(k, list) else k: _read_tree(v, buf, base) for k, v in node["d"]}
    if "tp" in node:
        return tuple(_read_tree(v, buf, base) for v in node["tp"])
    return node["v"]


def decode(buf: bytearray, group: int | None = None) -> StepMessage:
    """The message in `buf` (its tensors share buf's memory). group: decode only that group's step
    (the others come back as None): a rank runs its own group's rows only."""
    magic, kind, desc_len = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RuntimeError(f"step message: bad magic {magic!r} (a torn or foreign ring slot)")
    desc = json.loads(bytes(buf[_HEAD.size:_HEAD.size + desc_len]))
    base = -(-(_HEAD.size + desc_len) // _ALIGN) * _ALIGN
    groups = []
    for i, g in enumerate(desc["groups"]):
        if group is not None and i != group:
            groups.append(None)
            continue
        bucket = None if g["bucket"] is None else Bucket(*g["bucket"])
        groups.append(GroupStep(_read_tree(g["step"], buf, base), bucket, g["num_logits"],
                                _read_tree(g.get("plan", {"v": None}), buf, base)))
    return StepMessage(kind, groups, desc["gather_rows"], desc.get("head"))

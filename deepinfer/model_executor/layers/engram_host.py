"""Engram on the host (docs/neuron.md §5.9): the tables stay in host memory, the rows a step reads are
hashed and gathered there, and only those rows travel to the device with the step.

- `HostTableOwner`: a module whose table (`embed`) is no child of it: `model.to(device)` (any
  `_apply`) never reaches it, nor do `parameters()` / `buffers()`, while `state_dict()` /
  `load_state_dict()` and `get_submodule` still see it under its checkpoint name
  (`layers.{i}.engram.embed.weight`), so the loader, the shared-memory tables and the reports work
  by name as before.
- `gather_step_rows`: the host stage of a step (RunnerStrategy.to_device runs it before `step_to`):
  the n-gram hash in exact int64 on CPU tensors (`engram_hash.engram_indices`), then each layer's
  rows, dequantized, stacked into one tensor, `StepInputs.engram_rows` [L_engram, T, K * head_dim]:
  one host -> device copy for every Engram layer of the step. The device never sees the hash inputs.
- `engram_device_bytes`: Engram table bytes among the tensors `model.to(device)` moves (0 by
  construction; measured, so a table registered as a parameter or buffer would show).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn

from deepinfer.model_executor.layers.engram import engram_embed
from deepinfer.model_executor.layers.engram_hash import engram_indices

TABLE = "embed"   # the attribute of a HostTableOwner that holds its table module


class HostTableOwner(nn.Module):
    """Holds its table module outside the module tree (see the module docstring)."""

    def __setattr__(self, name, value):
        if name == TABLE:
            if not isinstance(value, nn.Module):
                raise TypeError(f"{TABLE}: a host table is an nn.Module, got {type(value).__name__}")
            self.__dict__["_host_table"] = value
        else:
            super().__setattr__(name, value)

    @property
    def embed(self) -> nn.Module:
        return self.__dict__["_host_table"]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.embed.state_dict(destination=destination, prefix=f"{prefix}{TABLE}.", keep_vars=keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        table_prefix = f"{prefix}{TABLE}."
        mine = {k: v for k, v in state_dict.items() if k.startswith(table_prefix)}
        # local_metadata carries load_state_dict's assign flag: a meta-built table is assigned too
        self.embed._load_from_state_dict(mine, table_prefix, local_metadata, strict, missing_keys,
                                         unexpected_keys, error_msgs)
        rest = {k: v for k, v in state_dict.items() if not k.startswith(table_prefix)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"host table: {self.embed}"


def host_tables(model: nn.Module) -> dict[str, nn.Module]:
    """Module path of each host table (`layers.1.engram.embed`) -> its module, in layer order."""
    return {f"{path}.{TABLE}": mod.embed for path, mod in model.named_modules() if isinstance(mod, HostTableOwner)}


# model -> {layer id: its HostTableOwner}: a step reads its layers' tables every step, and walking
# named_modules() for them cost ~0.4 ms of a ~9 ms compiled batch-1 decode step of the tiny V4.1
# (cProfile). The module tree is fixed once a model is built; the owner's table (`embed`) is still
# read at each call, so a table loaded or assigned later is seen.
_LAYER_OWNERS: "weakref.WeakKeyDictionary[nn.Module, dict[int, HostTableOwner]]" = weakref.WeakKeyDictionary()


def layer_table_owners(model: nn.Module) -> dict[int, HostTableOwner]:
    """Decoder layer id -> the HostTableOwner under `layers.{id}` (computed once per model)."""
    owners = _LAYER_OWNERS.get(model)
    if owners is None:
        owners = {int(path.split(".")[1]): mod for path, mod in model.named_modules()
                  if isinstance(mod, HostTableOwner) and path.startswith("layers.")}
        _LAYER_OWNERS[model] = owners
    return owners


def host_table_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full state_dict name -> tensor of every host table (weight, and the exponents of a packed one)."""
    out = {}
    for path, table in host_tables(model).items():
        for leaf, t in [*table.named_parameters(recurse=False), *table.named_buffers(recurse=False)]:
            out[f"{path}.{leaf}"] = t
    return out


def engram_device_bytes(model: nn.Module) -> int:
    """Bytes of Engram table storage among the model's parameters and buffers (what `model.to(device)`
    moves into HBM): a tensor counts when it shares a host table's storage or carries an Engram table
    name. 0 while the tables are host tables."""
    table_storages = {t.untyped_storage()._cdata for t in host_table_tensors(model).values()}
    total, seen = 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None:
            continue
        key = t.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        if key in table_storages or ".engram.embed." in f".{name}":
            total += t.untyped_storage().nbytes()
    return total


def table_rows(table: nn.Module, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one host table for row indices [T, K] (-1 = no lookup -> zeros) -> [T, K * head_dim] in
    `dtype`, dequantized on the host (a packed table: e4m3 codes in the platform's byte layout, which
    decode to the same values on the CPU, neuron_ops/fp8.py)."""
    from deepinfer.model_executor.layers.packed_weights import PackedFp8Table
    from deepinfer.model_executor.layers.quant_gemm import fp8_table_rows
    rows = rows.to(table.weight.device)   # the host, or meta in the full-scale dry runs
    if isinstance(table, PackedFp8Table):
        return fp8_table_rows(table.weight, table.scale, rows, table.group, dtype)
    return engram_embed(table.weight, rows).to(dtype)


def gather_step_rows(model: nn.Module, step):
    """`step` (host-built StepInputs) with `engram_rows` filled and the n-gram ids dropped (nothing on
    the device reads them); the step itself when the model has no Engram layer or the rows are there.
    ValueError when the n-gram ids are not host tensors (the hash runs on the host only)."""
    spec = getattr(model, "engram_spec", None)
    if spec is None or step.engram_rows is not None or step.ngram_ids is None:
        return step
    G = step.ngram_ids
    if G.device.type != "cpu":
        raise ValueError(f"Engram: the n-gram ids must be host tensors (the hash and the row fetch run on the "
                         f"host before the step is copied to the device, docs/neuron.md §5.9), got {G.device}")
    tables = {lid: owner.embed for lid, owner in layer_table_owners(model).items()}
    missing = [lid for lid in spec.layer_ids if lid not in tables]
    if missing:
        raise ValueError(f"Engram: layers {missing} have no host table in this model")
    dtype = getattr(model, "dtype", torch.float32)
    rows = torch.stack([table_rows(tables[lid], engram_indices(spec, lid, G), dtype) for lid in spec.layer_ids])
    return dataclasses.replace(step, engram_rows=rows, ngram_ids=None)


def layer_rows(model: nn.Module, step) -> dict[int, torch.Tensor]:
    """Engram layer id -> its gathered rows [T, K * head_dim] (views of `step.engram_rows`), for the
    forward. A step still holding host n-gram ids is gathered here (a forward called on host tensors,
    outside a runner); one on a device without gathered rows is an error."""
    spec = getattr(model, "engram_spec", None)
    if spec is None:
        return {}
    if step.engram_rows is None:
        if step.ngram_ids is None:
            return {}
        step = gather_step_rows(model, step)
    return {lid: step.engram_rows[j] for j, lid in enumerate(spec.layer_ids)}

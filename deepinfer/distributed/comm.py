"""The collectives the model calls, over the groups of groups.py.

Every call goes through here, so that
- a group of one rank (None) costs nothing: the call returns its input;
- they are traceable: the functional collectives (torch.distributed._functional_collectives) are
  what Dynamo compiles into a region graph, on gloo (host mode) as on the device backend;
- they can be counted: `record_collectives()` logs (op, group size, bytes) of every call in a
  block, which tests and the full-scale dry run (examples/neuron/memory_report.py) read;
- no all_to_all is ever issued while `ALLOW_ALL_TO_ALL` is False (the Neuron policy, docs/neuron.md
  §5.5: gloo has one, the device backend's is unreliable, so host mode enforces the same rule).
"""
from __future__ import annotations

import contextlib

import torch

ALLOW_ALL_TO_ALL = False
_records: list[list[dict]] = []


@contextlib.contextmanager
def record_collectives():
    """Yields a list that receives {"op", "group_size", "bytes"} for every collective issued inside."""
    log: list[dict] = []
    _records.append(log)
    try:
        yield log
    finally:
        # by identity: nested logs can be equal lists (a layer's log and the step's, after one layer)
        del _records[next(i for i, x in enumerate(_records) if x is log)]


def _group_size(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group)


def _record(op: str, group, t: torch.Tensor) -> None:
    if _records:
        entry = {"op": op, "group_size": _group_size(group), "bytes": t.numel() * t.element_size()}
        for log in _records:
            log.append(entry)


def all_reduce(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """A new tensor: the elementwise `op` ("sum" | "max") of t over the group."""
    if group is None:
        return t
    import torch.distributed._functional_collectives as funcol
    _record("all_reduce", group, t)
    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenation along dim 0 of every member's t (same shape on every rank), in rank order."""
    if group is None:
        return t
    import torch.distributed._functional_collectives as funcol
    _record("all_gather", group, t)
    return funcol.wait_tensor(funcol.all_gather_single(t, 0, group))


def reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group of t [group_size * R, ...], then row block r goes to member r."""
    if group is None:
        return t
    import torch.distributed._functional_collectives as funcol
    _record("reduce_scatter", group, t)
    return funcol.wait_tensor(funcol.reduce_scatter_single(t, "sum", 0, group))


def all_to_all(*args, **kwargs):
    if not ALLOW_ALL_TO_ALL:
        raise RuntimeError("all_to_all is not used on Neuron (docs/neuron.md §5.5); tokens move by "
                           "all-gather and reduce-scatter")
    raise NotImplementedError("no all_to_all path is implemented")

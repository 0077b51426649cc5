"""Report float8 ops that are wrong on trn2 (docs/neuron.md §4 A2, A3): cat / stack of float8, and advanced
indexing / gather / scatter / where / index_select touching a float8 tensor.

`Fp8Guard` is a TorchFunctionMode for eager code (loading, the eager top level, eager layers): every
such call is recorded with its call site (the innermost frame outside torch and this file).
`graph_fp8_sites(gm)` does the same for a traced FX graph (compiled regions), from node metadata.
`graph_float8_sites(gm)` is the stricter scan of region graphs: any float8 value at all (input,
output, intermediate, constant or dtype argument), since fp8 bytes cross a graph only as uint8 and
are reinterpreted inside a kernel's custom op (docs/neuron.md §4 A6, A9, A11; §7).
Enabled for a run by DEEPINFER_NEURON_FP8_GUARD=1 (the platform reads it); CPU runs must report zero.
"""
from __future__ import annotations

import operator
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_FP8 = {d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")) if d is not None}

# always unsafe on a float8 operand
_ALWAYS = {
    torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat", torch.stack: "stack",
    torch.hstack: "stack", torch.vstack: "stack", torch.gather: "gather", torch.Tensor.gather: "gather",
    torch.scatter: "scatter", torch.Tensor.scatter: "scatter", torch.Tensor.scatter_: "scatter",
    torch.scatter_add: "scatter", torch.Tensor.scatter_add: "scatter", torch.Tensor.scatter_add_: "scatter",
    torch.where: "where", torch.Tensor.where: "where", torch.index_select: "index_select",
    torch.Tensor.index_select: "index_select", torch.take: "take", torch.Tensor.index_put_: "index_put",
    torch.Tensor.index_put: "index_put", torch.index_put: "index_put", torch.Tensor.index_copy_: "index_copy",
    torch.Tensor.index_add_: "index_add", torch.masked_select: "masked_select",
}
_INDEXING = {torch.Tensor.__getitem__: "advanced-index", torch.Tensor.__setitem__: "advanced-index-store"}

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def is_fp8(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _FP8


def _advanced(index) -> bool:
    return any(isinstance(i, (torch.Tensor, list)) for i in (index if isinstance(index, tuple) else (index,)))


def call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown>"


@dataclass
class Fp8Report:
    sites: Counter = field(default_factory=Counter)   # (op, call site) -> count

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def lines(self) -> list[str]:
        return [f"{op} on float8 at {site} (x{n})" for (op, site), n in sorted(self.sites.items())]


class Fp8Guard(TorchFunctionMode):
    """with Fp8Guard() as g: ...; g.report.lines(). raise_on_site=True raises at the first site."""

    def __init__(self, raise_on_site: bool = False):
        super().__init__()
        self.report = Fp8Report()
        self.raise_on_site = raise_on_site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _ALWAYS.get(func)
        if op is None and func in _INDEXING and len(args) >= 2 and _advanced(args[1]):
            op = _INDEXING[func]
        if op is not None and any(is_fp8(t) for t in tree_leaves((args, kwargs))):
            site = call_site()
            if self.raise_on_site:
                raise RuntimeError(f"unsafe float8 op {op} at {site} (docs/neuron.md §4 A2/A3): use a uint8 view")
            self.report.sites[(op, site)] += 1
        return func(*args, **kwargs)


_FX_UNSAFE = {"cat", "concat", "concatenate", "stack", "hstack", "vstack", "gather", "scatter", "scatter_add",
              "where", "index", "index_put", "index_select", "take", "index_copy", "index_add", "masked_select",
              "embedding"}


def _meta(v):
    if isinstance(v, torch.fx.Node):
        return v.meta.get("val", v.meta.get("example_value"))
    return None


def graph_fp8_sites(gm: torch.fx.GraphModule) -> list[str]:
    """Unsafe float8 ops in a traced graph (Dynamo torch-level or aten-level), as 'op (source line)'."""
    out = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if node.target in (operator.getitem, operator.setitem):
            # advanced indexing: a tensor among the indices
            index = node.args[1] if len(node.args) > 1 else None
            if not any(isinstance(_meta(i), torch.Tensor) for i in tree_leaves(index)):
                continue
            name = "advanced-index"
        else:
            name = _target_name(node).split(".")[0].rstrip("_")
            if name not in _FX_UNSAFE:
                continue
        vals = [_meta(a) for a in tree_leaves((node.args, node.kwargs))] + [_meta(node)]
        if any(is_fp8(v) for v in tree_leaves(vals)):
            out.append(_site(node, name))
    return out


def _target_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _site(node: torch.fx.Node, what: str) -> str:
    """'what (the source line that made the node)', or the node's name where no trace was kept."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = trace[-2].strip() if len(trace) >= 2 else node.name
    return f"{what} ({where})"


def _float8_dtypes(values) -> list:
    out = []
    for v in tree_leaves(values):
        if isinstance(v, torch.dtype) and v in _FP8:
            out.append(v)
        elif isinstance(v, torch.Tensor) and v.dtype in _FP8:
            out.append(v.dtype)
    return out


def graph_float8_sites(gm: torch.fx.GraphModule) -> list[str]:
    """Every float8 value in a traced graph (Dynamo torch-level or aten-level, or make_fx), as
    '<node> <dtype> (source line)': placeholders (inputs), node results (intermediates, outputs),
    constants held by the module, and float8 dtypes passed as arguments (a `.view(float8)` /
    `.to(float8)`). An opaque custom op whose fake takes and returns uint8 adds none."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        found = _float8_dtypes(node.meta.get("val", node.meta.get("example_value")))
        if node.op == "get_attr":   # a constant the module holds (a dotted path into submodules)
            try:
                found += _float8_dtypes(operator.attrgetter(str(node.target))(gm))
            except AttributeError:
                pass
        if node.op in ("call_function", "call_method"):
            found += _float8_dtypes((node.args, node.kwargs))
        if found:
            kind = "input" if node.op == "placeholder" else _target_name(node)
            out.append(_site(node, f"{kind} {sorted({str(d).removeprefix('torch.') for d in found})[0]}"))
    return out

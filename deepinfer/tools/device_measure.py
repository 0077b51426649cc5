"""The device report's measurements of traced graphs and rank tensors, in one place
(tools/device_report.py reads them; each is a function of the graph or the model, nothing assumed).

- `measure_graph(gm, args)`: running the graph (on meta: shapes only) under a TorchDispatchMode, the
  largest tensor any of its ops allocates (ops whose results alias an input, views and in-place
  writes such as a cache store, allocate nothing and are skipped) and its float8 values (inputs and
  op outputs of a float8 dtype);
- `float8_sites`: those values, with the unsafe float8 ops of the FX graph (fp8_guard.graph_fp8_sites:
  cat / index of float8, §4 A2/A3);
- `int64_sites(gm)`: the graph's integer constants outside the int32 range, the values a device
  narrows (§4 A4) or rejects (NCC_ESFH001, §4 A5); values computed from tensor inputs are not
  bounded by a scan: the metadata they come from is row indices and positions below the pool sizes,
  inside int32 by construction (model_executor/step_pack.py);
- `engram_device_bytes(model)`: the bytes of Engram tables among the tensors `model.to(device)` would
  move (layers/engram_host.py keeps them in host memory);
- `TracedGraphs`: a RegionRunner whose backend records every graph Dynamo compiles for a bucket.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deepinfer.neuron_ops.fp8_guard import graph_fp8_sites, is_fp8
from deepinfer.neuron_ops.regions import RegionRunner, int64_constant_sites


class _OpOutputs(TorchDispatchMode):
    """The largest new tensor of the ops run under it, and the ops that produce float8 values."""

    # torch.cond (layers/row_chunks.py scope_branch) reaches the mode as a higher-order operator
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None
        self.float8: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.higher_order.cond:
            return self._cond(*args)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.float8 += [f"{name} -> {t.dtype}" for t in tensors if is_fp8(t)]
        if any(r.alias_info is not None for r in func._schema.returns):
            return out   # a view or an in-place result: no new tensor (a cache write returns its cache)
        for t in tensors:
            n = t.numel() * t.element_size()
            if n > self.largest:
                self.largest, self.op = n, name
        return out

    def _cond(self, pred, true_fn, false_fn, operands):
        """Both branches run under the mode, since the graph holds both (their intermediates and
        float8 values count); the result is the taken branch's, the true one on meta (both branches
        give the same shapes and dtypes, and a meta result has no values)."""
        with self:
            taken = true_fn(*operands)
            other = false_fn(*operands)
        return taken if pred.is_meta or bool(pred) else other


def measure_graph(gm, args) -> tuple[int, str | None, list[str], object]:
    """(largest output bytes, its op, float8 values, outputs) of running gm(*args): float8 values are
    the graph's float8 inputs and every op output of a float8 dtype (views included: a float8 view of
    uint8 bytes is a float8 value in the graph, §4 A6)."""
    mode = _OpOutputs()
    inputs = [f"input {i} -> {a.dtype}" for i, a in enumerate(args) if isinstance(a, torch.Tensor) and is_fp8(a)]
    with mode:
        out = gm(*args)
    return mode.largest, mode.op, inputs + mode.float8, out


def int64_sites(gm) -> list[str]:
    return int64_constant_sites(gm)


def engram_device_bytes(model) -> int:
    """The Engram table bytes among the tensors `model.to(device)` moves (layers/engram_host.py keeps
    the tables out of them, so this is 0 unless a table got registered as a module tensor)."""
    from deepinfer.model_executor.layers.engram_host import engram_device_bytes as on_device
    return on_device(model)


class TracedGraphs:
    """Graphs of the Neuron regions as Dynamo hands them to the backend, one row each."""

    def __init__(self, split: str):
        self.graphs: list[dict] = []
        self.bucket = None
        self.runner = _RecordingRunner(self, split)

    def trace_plan(self, strategy, cache, log=None) -> None:
        """Every bucket warm-up walks (and the draft blocks, and the verify_draft graphs), through the
        strategy's forward on meta."""
        from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
        from deepinfer.platforms.neuron.compile_plan import exit_logits_rows
        spec = strategy.buckets
        for bucket in spec.all_buckets():
            self.bucket = (strategy.plan.step_of(bucket), bucket.num_tokens, bucket.context)
            step = spec.static_step([], bucket, strategy.layout, logits_rows=exit_logits_rows(bucket, spec))
            strategy.forward(strategy.to_device(step, bucket), cache, bucket)
            if log:
                log(f"traced {self.bucket}: {len(self.graphs)} graphs so far")
        if strategy.drafts and hasattr(strategy.model, "mtp"):
            noise = int(strategy.model.cfg.dspark_noise_token_id)
            for rows in spec.batch:
                self.bucket = ("draft", strategy.draft_tokens(rows), 0)
                block = DraftBlock([], [], [], strategy.drafts).padded(rows)
                strategy.forward_draft(strategy.draft_to_device(draft_step_inputs(block, strategy.layout, noise)),
                                       cache)
            # a greedy verification step's acceptance and draft block (its forward's graphs are traced)
            for bucket, rows in strategy.greedy_spec_buckets():
                self.bucket = ("draft", strategy.draft_tokens(rows), 0)
                strategy.greedy_spec_placeholders(bucket, rows, cache)

    def rows(self) -> list[dict]:
        return list(self.graphs)


class _RecordingRunner(RegionRunner):
    def __init__(self, traced: TracedGraphs, split: str):
        super().__init__("eager", split=split)
        self.traced = traced

    def _backend_for(self, kind, region: str):
        traced, stats = self.traced, self.stats

        def backend(gm, example_inputs):
            stats.graphs[kind] += 1
            stats.regions[region] += 1
            step, tokens, context = traced.bucket
            row = {"name": f"{region}/{kind if isinstance(kind, str) else f'kind{kind}'}/{step}",
                   "kind": kind if isinstance(kind, str) else f"layer kind {kind}", "region": region,
                   "tokens": tokens, "context": context, "max_intermediate_bytes": None, "largest_op": None,
                   "float8_sites": graph_fp8_sites(gm), "int64_sites": int64_sites(gm)}
            traced.graphs.append(row)
            # a torch.cond cannot read its predicate on meta tensors: such a graph always runs under
            # the mode, which runs both branches
            has_cond = any(n.target is torch.ops.higher_order.cond for n in gm.graph.nodes)

            def run(*args):
                if row["max_intermediate_bytes"] is None:
                    row["max_intermediate_bytes"], row["largest_op"], values, out = measure_graph(gm, args)
                    row["float8_sites"] = sorted(set(row["float8_sites"]) | set(values))
                    return out
                if has_cond:
                    with _OpOutputs():
                        return gm(*args)
                return gm(*args)
            return run
        return backend

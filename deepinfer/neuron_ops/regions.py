"""Decoder layers compiled as regions, one compiled entry per layer kind (docs/neuron.md §5.2).

`RegionRunner.run_top` runs the model's top level (step entry, step exit, a draft block) as regions
of their own (TOP_REGIONS). `RegionRunner.hook(num_seqs, num_tokens)` is the model's
`run_layer` hook for a step of that bucket: each decoder layer runs as one compiled region (attention
half + MoE), or as three sub-regions (`SUB_REGIONS`: projections | indexer and attention | MoE) when
the split policy says so for the step (`SPLIT_POLICIES`, DEEPINFER_NEURON_REGION_SPLIT;
docs/neuron.md §4 B4, C5). The layer's code reads no layer id and gets its caches and cross-layer
inputs through `LayerIO` (models/v4_common.py), so every layer of a kind runs the same graph: each
(kind, region) gets its own function object (its own Dynamo cache), whose entries are one graph per
static shape (bucket). The graph count is kinds x buckets x regions a bucket, independent of the
number of layers (docs/neuron.md §4 F1; counted ahead by platforms/neuron/compile_plan.py).

Backends: host mode "aot_eager" (reproduces Dynamo guards, graph breaks and AOTAutograd alias
checks) or "inductor"; device mode "neuron" (torch-neuronx, imported lazily). Every graph is also
scanned for float8 values (`graph_float8_sites`: none may appear, fp8 bytes cross a graph as uint8;
A6, A9, A11), float8 ops unsafe on trn2 (A2, A3) and int64 constants outside the int32 range (A4, A5).
"""
from __future__ import annotations

import functools
import logging
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from deepinfer.neuron_ops.fp8_guard import graph_float8_sites, graph_fp8_sites

logger = logging.getLogger(__name__)

# Dynamo's default of 8 graphs per code object would cap the buckets a kind can see.
RECOMPILE_LIMIT = 64
_INT32 = (-(2 ** 31), 2 ** 31 - 1)


def layer_kind(layer) -> tuple:
    """The static facts that select a layer's region graph (everything the traced code branches on)."""
    ffn = layer.ffn
    engram = getattr(layer, "engram", None)
    facts = dict(hashed=ffn.hashed, n_experts=ffn.n_experts, topk=ffn.topk, is_target=layer.is_target,
                 is_shared_hidden_source=layer.is_shared_hidden_source)
    return kind_key(type(layer).__name__, layer.attn, facts,
                    None if engram is None else tuple(engram.embed.weight.shape))


def kind_key(layer_type: str, a, facts: dict, engram_shape: tuple | None) -> tuple:
    """layer_kind from its parts: the layer's class name, its Attention, its `layer_facts`
    (models/deepseek_v4.py) and the shape of its Engram table (None without one)."""
    idx = getattr(a, "indexer", None)
    return (
        layer_type, a.kind, a.ratio, a.comp_key, a.src_comp_key, a.is_index_source,
        idx is not None and hasattr(idx, "wk"), idx is not None and hasattr(idx, "compressor"),
        a.uses_shared_hidden, a.candidate_source, a.candidate_consumer,
        facts["is_target"], facts["is_shared_hidden_source"],
        facts["hashed"], facts["n_experts"], facts["topk"],
        engram_shape,
    )


def int64_constant_sites(gm: torch.fx.GraphModule) -> list[str]:
    """Integer constants outside the int32 range in a graph: narrowed to int32 on device (A4) or
    rejected (NCC_ESFH001, A5)."""
    out = []
    for node in gm.graph.nodes:
        for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, int) and not isinstance(a, bool) and not _INT32[0] <= a <= _INT32[1]:
                name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
                out.append(f"{name}({a})")
    return out


# prompt: split prompt-chunk steps only: a 128-token chunk's attention ran 122 -> 62 ms a layer split,
# and the compiler segfaulted on long multi-row projections merged with the indexer, while decode
# rows are fastest whole (docs/neuron.md §4 B4, C5). A verification step (1 + B <= 8 tokens a row)
# runs whole too, so that it shares the graphs of the decode bucket of its token count (§5.10).
# multi_row: split every step where a sequence feeds several tokens (prompt chunks and verification).
# never / always: one region a layer, or sub-regions for every step.
SPLIT_POLICIES = ("prompt", "multi_row", "never", "always")
WHOLE = ("layer",)
SUB_REGIONS = ("projections", "attention", "ffn")
# The model's top level, one graph each per bucket: "entry" (the packed step inputs unpacked, prefix
# restores, embedding, RoPE tables), "exit" (the draft layers' main keys, HC collapse, final norm, LM
# head) and, with speculative decoding, "draft" (a whole DSpark draft block); each eager op between
# regions would be a launch of its own on a device (docs/neuron.md §4 C1, C4). "step" is a whole step
# (entry, every decoder layer, exit) as one graph: the cpu platform's default scope (COMPILE_SCOPES).
TOP_REGIONS = ("entry", "exit", "draft", "verify_draft", "step")
# What one graph of a bucketed step holds. layer: one region a decoder layer (or its sub-regions) plus
# the entry and exit graphs, so layers of one kind share a graph (what a device compiles: §5.10).
# step: the whole step in one graph, the layers unrolled: on a CPU every region call pays Dynamo's
# entry and inductor's Python wrapper, about 0.15 ms each, and inductor fuses only inside one graph
# (README "Compiled CPU decode step", "One graph a step", has the measurement).
COMPILE_SCOPES = ("layer", "step")


def checked_scope(scope: str) -> str:
    """`scope` if it is one of COMPILE_SCOPES, else a ValueError naming them."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope: expected one of {'|'.join(COMPILE_SCOPES)}, got {scope!r}")
    return scope


def splits(policy: str, num_seqs: int, num_tokens: int, prompt: bool | None = None) -> bool:
    """Whether a step of this bucket runs its layers as SUB_REGIONS under `policy`. prompt: whether the
    bucket is a prompt-chunk bucket (compile_plan.step_class); None: any multi-row bucket is."""
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"region split policy: expected one of {'|'.join(SPLIT_POLICIES)}, got {policy!r}")
    multi = num_tokens > num_seqs
    return (policy == "always" or (policy == "multi_row" and multi)
            or (policy == "prompt" and (multi if prompt is None else prompt)))


def regions_of_step(policy: str, num_seqs: int, num_tokens: int, prompt: bool | None = None) -> tuple[str, ...]:
    """The region names one layer runs as in a step of this bucket."""
    return SUB_REGIONS if splits(policy, num_seqs, num_tokens, prompt) else WHOLE


def _layer(layer, x, prev_pre, ctx, io):
    return layer(x, prev_pre, ctx, io)


def _projections(layer, x, prev_pre, ctx, io):
    return layer.attn_in(x, prev_pre, ctx, io)


def _attention(layer, staged, ctx, io):
    return layer.attn_out(*staged, ctx, io)


def _ffn(layer, x, pre, ctx):
    return layer.ffn_half(x, pre, ctx)


def _fresh(fn, tag: str):
    """A copy of `fn` with its own code object: Dynamo keeps compiled entries per code object, so
    each layer kind gets its own cache (and its own recompile budget)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


@dataclass
class RegionStats:
    graphs: Counter = field(default_factory=Counter)      # kind index -> graphs compiled
    regions: Counter = field(default_factory=Counter)     # region name (WHOLE, SUB_REGIONS) -> graphs
    kinds: list = field(default_factory=list)             # kind index -> layer_kind tuple
    fp8_sites: list = field(default_factory=list)        # unsafe ops on float8 (A2, A3)
    float8_sites: list = field(default_factory=list)     # any float8 value (A6, A9, A11)
    int64_sites: list = field(default_factory=list)

    @property
    def total_graphs(self) -> int:
        return sum(self.graphs.values())


def call_region(compiled, *args):
    """compiled(*args); where a call under torch's skip_guard_eval_unsafe stance (worker/runners/
    warm_guards.py) would have to recompile, torch refuses before running anything, and the call runs
    again with every guard evaluated (it compiles, and the warm-guards bookkeeping sees the new graph)."""
    try:
        return compiled(*args)
    except RuntimeError as e:
        if "skip_guard_eval_unsafe" not in str(e):
            raise
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):
        return compiled(*args)


class RegionRunner:
    """`run_layer` hooks for DeepseekV4Model.forward: compiled regions per layer kind."""

    def __init__(self, backend: str = "aot_eager", split: str = "never", fullgraph: bool = True,
                 scope: str = "layer", inductor_options: dict | None = None):
        """split: the policy of SPLIT_POLICIES (the platform passes DEEPINFER_NEURON_REGION_SPLIT);
        scope: COMPILE_SCOPES (the cpu platform passes DEEPINFER_CPU_COMPILE_SCOPE; a device compiles
        layers); inductor_options: inductor config patches for every region graph (backend inductor
        only; the cpu platform's DEEPINFER_CPU_COMPILE_WRAPPER)."""
        if backend not in ("aot_eager", "inductor", "eager", "neuron"):
            raise ValueError(f"backend: expected aot_eager, inductor, eager or neuron, got {backend!r}")
        splits(split, 1, 1)   # rejects an unknown policy
        if inductor_options and backend != "inductor":
            raise ValueError(f"inductor_options need the inductor backend, got {backend!r}")
        self.backend, self.split, self.fullgraph, self.scope = backend, split, fullgraph, checked_scope(scope)
        self.inductor_options = dict(inductor_options or {})
        self.stats = RegionStats()
        self._kind_of = weakref.WeakKeyDictionary()   # layer -> kind index (ids get reused)
        self._fns: dict[int, tuple] = {}      # kind index -> compiled callables
        self._top: dict[str, object] = {}     # TOP_REGIONS name -> compiled callable
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)

    def _backend_for(self, kind, region: str):
        if self.backend == "neuron":
            import torch_neuronx  # noqa: F401  (registers the "neuron" backend; device only)
        from torch._dynamo.backends.registry import lookup_backend
        inner = lookup_backend(self.backend)
        if self.inductor_options:
            from torch._inductor.compile_fx import compile_fx
            inner = functools.partial(compile_fx, config_patches=self.inductor_options)
        stats = self.stats

        def backend(gm, example_inputs):
            stats.graphs[kind] += 1
            stats.regions[region] += 1
            stats.fp8_sites += graph_fp8_sites(gm)
            stats.float8_sites += graph_float8_sites(gm)
            stats.int64_sites += int64_constant_sites(gm)
            logger.debug("region graph: %s of kind %s (%s), %d nodes", region, kind,
                         stats.kinds[kind] if isinstance(kind, int) else "top level", len(gm.graph.nodes))
            return inner(gm, example_inputs)
        return backend

    def _compiled(self, layer) -> tuple:
        k = self._kind_of.get(layer)
        if k is None:
            key = layer_kind(layer)
            if key not in self.stats.kinds:
                self.stats.kinds.append(key)
            k = self._kind_of[layer] = self.stats.kinds.index(key)
        if k not in self._fns:
            fns = zip(WHOLE + SUB_REGIONS, (_layer, _projections, _attention, _ffn))
            self._fns[k] = tuple(torch.compile(_fresh(f, f"kind{k}"), backend=self._backend_for(k, name),
                                               fullgraph=self.fullgraph, dynamic=False) for name, f in fns)
        return self._fns[k]

    @property
    def num_kinds(self) -> int:
        return len(self.stats.kinds)

    def hook(self, num_seqs: int, num_tokens: int, prompt: bool | None = None):
        """The `run_layer` hook of a step padded to (num_seqs, num_tokens): whole layers or sub-regions."""
        return self.run_split if splits(self.split, num_seqs, num_tokens, prompt) else self.run_whole

    def run_whole(self, layer, x, prev_pre, ctx, io):
        return call_region(self._compiled(layer)[0], layer, x, prev_pre, ctx, io)

    def run_top(self, name: str, fn, *args):
        """fn(*args) as the compiled top-level region `name` (TOP_REGIONS): one graph per static shape."""
        if name not in TOP_REGIONS:
            raise ValueError(f"top-level region: expected one of {'|'.join(TOP_REGIONS)}, got {name!r}")
        compiled = self._top.get(name)
        if compiled is None:
            compiled = self._top[name] = torch.compile(_fresh(fn, name), backend=self._backend_for(name, name),
                                                       fullgraph=self.fullgraph, dynamic=False)
        return call_region(compiled, *args)

    def run_split(self, layer, x, prev_pre, ctx, io):
        _, projections, attention, ffn = self._compiled(layer)
        x, pre = call_region(attention, layer, call_region(projections, layer, x, prev_pre, ctx, io), ctx, io)
        return call_region(ffn, layer, x, pre, ctx)

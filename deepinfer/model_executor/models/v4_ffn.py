"""Feed-forward side of the V4 / V4.1 decoder (docs/model.md §3.6-3.7): routed + shared experts with
score or hash routing, and the V4.1 Engram memory."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.checkpoint_formats import FP4, FP8, TABLE, stored_as
from deepinfer.model_executor.layers.engram_host import HostTableOwner
from deepinfer.model_executor.layers.ep_moe import ep_routed_experts
from deepinfer.model_executor.layers.moe import route, swiglu, use_active_experts
from deepinfer.model_executor.layers.packed_weights import PackedFp4Weight, PackedFp8Linear, linear_mm
from deepinfer.model_executor.models.v4_common import StepContext, f32_param, linear


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype, stored: str):
        """stored: the checkpoint format of its three projections (fp4 routed, fp8 shared experts)."""
        super().__init__()
        self.w1 = stored_as(stored, linear(dim, inter, dtype))
        self.w2 = stored_as(stored, linear(inter, dim, dtype))
        self.w3 = stored_as(stored, linear(dim, inter, dtype))


class Gate(nn.Module):
    def __init__(self, cfg, n_experts: int, topk: int, hashed: bool, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, cfg.hidden_size, dtype=dtype))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, topk, dtype=torch.long))
        else:
            self.bias = f32_param(n_experts)
        if cfg.is_v41:
            self.bias_vl = f32_param(n_experts)


class ExpertDict(nn.ModuleDict):
    """The routed experts a rank holds, keyed by their global id (as a string, so state_dict names stay
    the checkpoint's `ffn.experts.{id}.*`); `experts[id]` takes the int id too."""

    def __getitem__(self, key):
        return super().__getitem__(str(key))


class MoE(nn.Module):
    def __init__(self, cfg, hashed: bool, dtype, n_experts: int | None = None, topk: int | None = None,
                 experts: range | None = None, ep=None, tokens_replicated: bool = True,
                 shared_units: range | None = None, shared_weight: float = 1.0):
        """experts: the global ids this rank holds (expert parallelism, model_executor/shard_plan.py),
        None for all; ep: the EP process group (None: no collective, the rank's own partial sum);
        tokens_replicated: every member of the EP group runs the same tokens (EP group inside a CP
        group), layers/ep_moe.py; shared_units: the shared expert's intermediate units this rank
        holds (split over the lane's part of the EP group, model_executor/shard_plan.py), None for
        all of them; shared_weight: the factor on its partial in the EP combine (s / ep: the group
        holds ep / s runs of ranks that each make a whole shared output)."""
        super().__init__()
        self.cfg = cfg
        self.n_experts = n_experts or cfg.n_routed_experts
        self.topk = topk or cfg.n_experts_per_tok
        self.hashed = hashed
        self.gate = Gate(cfg, self.n_experts, self.topk, hashed, dtype)
        held = range(self.n_experts) if experts is None else experts
        self.expert_start, self.n_local = held.start, len(held)
        self.ep, self.tokens_replicated = ep, tokens_replicated
        self.experts = ExpertDict({str(e): Expert(cfg.hidden_size, cfg.moe_inter_size, dtype, FP4) for e in held})
        shared_inter = cfg.moe_inter_size * max(1, cfg.n_shared_experts)
        self.shared_split = shared_units is not None and len(shared_units) < shared_inter
        self.shared_weight = shared_weight
        self.shared_experts = Expert(cfg.hidden_size, len(shared_units) if self.shared_split else shared_inter,
                                     dtype, FP8)
        # The kernels read the held experts stacked: [E, 2I, D] (gate rows first) and [E, D, I], or their
        # packed fp4 codes and exponents. Non-persistent buffers: not checkpoint tensors, but moved by
        # model.to(device) like the weights. `pack` builds them and makes each expert's own tensors
        # views into them, so the weights are held once.
        for name in ("_w13", "_w2", "_w13_scale", "_w2_scale"):
            self.register_buffer(name, None, persistent=False)

    @property
    def first_expert(self) -> Expert:
        return next(iter(self.experts.values()))

    @property
    def packed_experts(self) -> bool:
        return isinstance(self.first_expert.w1, PackedFp4Weight)

    @torch.no_grad()  # the stacks are weights, not results: no autograd history (draft distillation trains them)
    def pack(self):
        """Stack the experts' weights once after loading; the per-expert modules keep the checkpoint
        names and become views of the stacks."""
        held = list(self.experts.values())
        rows = held[0].w1.weight.shape[0]

        def w13(name: str) -> torch.Tensor:
            # [E, 2 * rows, cols]: two stacks and one cat, not one cat per expert (each op costs, on
            # meta above all: the full-size memory reports build every expert of every layer)
            return torch.cat([torch.stack([getattr(e.w1, name) for e in held]),
                              torch.stack([getattr(e.w3, name) for e in held])], dim=1)
        self._w13 = w13("weight")
        self._w2 = torch.stack([e.w2.weight for e in held])
        if self.packed_experts:
            self._w13_scale = w13("scale")
            self._w2_scale = torch.stack([e.w2.scale for e in held])
        elif self._w13.dtype == torch.float32:  # fp32: stored transposed (see DeepseekV4Model.post_load)
            self._w13 = self._w13.transpose(1, 2).contiguous().transpose(1, 2)
            self._w2 = self._w2.transpose(1, 2).contiguous().transpose(1, 2)
        for i, e in enumerate(held):
            _rebind(e.w1, "weight", self._w13[i, :rows])
            _rebind(e.w3, "weight", self._w13[i, rows:])
            _rebind(e.w2, "weight", self._w2[i])
            if self.packed_experts:
                _rebind(e.w1, "scale", self._w13_scale[i, :rows])
                _rebind(e.w3, "scale", self._w13_scale[i, rows:])
                _rebind(e.w2, "scale", self._w2_scale[i])

    def run_experts(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, k, static_shapes: bool) -> torch.Tensor:
        """The held experts' weighted sum for rows x; idx are local expert ids ([0, n_local)), in x's dtype."""
        limit = self.cfg.swiglu_limit
        # fixed shapes: only the hit experts while few are hit, else every held expert (layers/moe.py)
        active = static_shapes and use_active_experts(x.shape[0], self.topk, self.n_experts)
        if self.packed_experts:
            experts = ((k.fp4_active_experts if active else k.fp4_static_experts) if static_shapes
                       else k.fp4_routed_experts)
            return experts(x, idx, w, self._w13, self._w13_scale, self._w2, self._w2_scale,
                           self.first_expert.w1.group, limit)
        experts = (k.moe_experts_active if active else k.moe_experts_static) if static_shapes else k.moe_experts
        return experts(x, idx, w, self._w13, self._w2, limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, k, static_shapes: bool = False,
                token_valid: torch.Tensor | None = None) -> torch.Tensor:
        if self._w13 is None:
            self.pack()
        hashed = self.gate.tid2eid[token_ids] if self.hashed else None
        bias = None if self.hashed else self.gate.bias
        idx, w = route(x, self.gate.weight, bias, self.topk, self.cfg.routed_scaling_factor, hashed)
        if self.n_local == self.n_experts:
            if token_valid is not None:   # placeholder rows select no expert: zero weights
                w = torch.where(token_valid[:, None], w, torch.zeros_like(w))
            y = self.run_experts(x, idx, w, k, static_shapes)
        else:
            # a split shared expert's partial output travels in the routed experts' combine
            shared = self.shared_partial if self.shared_split else None
            y = ep_routed_experts(self, x, idx, w, token_valid, k, static_shapes, shared)
            if shared is not None:
                return y
        return y + self.shared_output(x, k)

    def shared_partial(self, x: torch.Tensor, k) -> torch.Tensor:
        """fp32: this rank's share of the shared expert in the EP combine (its units' partial sum,
        times shared_weight; a bf16 model rounds the partial to bf16 once, like the routed ones)."""
        y = self.shared_output(x, k).float()
        return y if self.shared_weight == 1.0 else y * self.shared_weight

    def shared_output(self, x: torch.Tensor, k) -> torch.Tensor:
        """The shared expert on rows x (of its held units only, when split: a partial sum), in x's dtype."""
        limit = self.cfg.swiglu_limit
        s = self.shared_experts
        if isinstance(s.w1, PackedFp8Linear):
            return linear_mm(swiglu(linear_mm(x, s.w1, k), linear_mm(x, s.w3, k), limit), s.w2, k)
        return k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, limit)


def _rebind(module: nn.Module, name: str, view: torch.Tensor) -> None:
    """Replace a module's parameter or buffer by `view` (same shape), so its old storage is freed."""
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(view, requires_grad=False)
    else:
        module._buffers[name] = view


class Engram(HostTableOwner):
    """The V4.1 Engram memory of one layer. Its table (`embed`) is a host table (layers/engram_host.py):
    never moved to the device; the step brings this layer's rows, hashed and gathered on the host
    (`StepInputs.engram_rows`), so the forward is the combine alone: projection and gated add."""

    def __init__(self, cfg, layer: int, rows: int, dtype, spec):
        super().__init__()
        self.cfg, self.layer, self.spec = cfg, layer, spec
        n_hc, dim = cfg.hc_mult, cfg.hidden_size
        n_embed = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.embed = stored_as(TABLE, nn.Module())  # the table is named `engram.embed.weight` in the checkpoint
        self.embed.weight = nn.Parameter(torch.zeros(rows, cfg.engram_head_dim, dtype=dtype))
        self.q_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.wkv = stored_as(FP8, linear(n_embed, (n_hc + 1) * dim, dtype))

    def forward(self, x: torch.Tensor, ctx: StepContext, rows: torch.Tensor) -> torch.Tensor:
        """x: [T, n, D] trunk; rows: this layer's gathered table rows [T, K * head_dim] in x's dtype."""
        kv = linear_mm(rows, self.wkv, ctx.k)
        return ctx.k.engram_gate(x, kv, self.q_weight, self.k_weight, self.cfg.rms_norm_eps)

"""Feed-forward side of the V4 / V4.1 decoder (docs/model.md §3.6-3.7): routed + shared experts with
score or hash routing, and the V4.1 Engram memory."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.engram import engram_embed
from deepinfer.model_executor.layers.moe import route
from deepinfer.model_executor.models.v4_common import StepContext, f32_param, linear


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype):
        super().__init__()
        self.w1 = linear(dim, inter, dtype)
        self.w2 = linear(inter, dim, dtype)
        self.w3 = linear(dim, inter, dtype)


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


class MoE(nn.Module):
    def __init__(self, cfg, hashed: bool, dtype, n_experts: int | None = None, topk: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.n_experts = n_experts or cfg.n_routed_experts
        self.topk = topk or cfg.n_experts_per_tok
        self.hashed = hashed
        self.gate = Gate(cfg, self.n_experts, self.topk, hashed, dtype)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_inter_size, dtype)
                                     for _ in range(self.n_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_inter_size * max(1, cfg.n_shared_experts), dtype)
        # non-persistent buffers: not checkpoint tensors, but moved by model.to(device) like the weights
        self.register_buffer("_w13", None, persistent=False)
        self.register_buffer("_w2", None, persistent=False)

    def pack(self):
        """Stack expert weights once after loading (the per-expert modules keep the checkpoint names)."""
        # fp32: stored transposed (see post_load)
        w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])
        w2 = torch.stack([e.w2.weight for e in self.experts])
        if w13.dtype == torch.float32:
            w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
            w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        self._w13, self._w2 = w13, w2

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, k, static_shapes: bool = False) -> torch.Tensor:
        if self._w13 is None:
            self.pack()
        hashed = self.gate.tid2eid[token_ids] if self.hashed else None
        bias = None if self.hashed else self.gate.bias
        idx, w = route(x, self.gate.weight, bias, self.topk, self.cfg.routed_scaling_factor, hashed)
        experts = k.moe_experts_static if static_shapes else k.moe_experts
        y = experts(x, idx, w, self._w13, self._w2, self.cfg.swiglu_limit)
        s = self.shared_experts
        return y + k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, self.cfg.swiglu_limit)


class Engram(nn.Module):
    def __init__(self, cfg, layer: int, rows: int, dtype, spec):
        super().__init__()
        self.cfg, self.layer, self.spec = cfg, layer, spec
        n_hc, dim = cfg.hc_mult, cfg.hidden_size
        n_embed = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.embed = nn.Module()  # the table is named `engram.embed.weight` in the checkpoint
        self.embed.weight = nn.Parameter(torch.zeros(rows, cfg.engram_head_dim, dtype=dtype))
        self.q_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n_hc, dim, dtype=dtype))
        self.wkv = linear(n_embed, (n_hc + 1) * dim, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext, rows: torch.Tensor) -> torch.Tensor:
        e = engram_embed(self.embed.weight, rows).to(x.dtype)
        kv = e @ self.wkv.weight.t()
        return ctx.k.engram_gate(x, kv, self.q_weight, self.k_weight, self.cfg.rms_norm_eps)

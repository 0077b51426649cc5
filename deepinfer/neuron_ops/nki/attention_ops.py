"""Torch entry points of the attention, indexer and mHC kernels, with the references' argument
lists (deepinfer/neuron_ops/refs PLAIN) and output dtypes. `WRAPPERS` maps kernel names to these
wrappers, for the kernel registry (nki/registry.py) to take in."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from deepinfer.neuron_ops.nki import api, ops
from deepinfer.neuron_ops.nki.kernels.hc import K_TILE, hc_mixes_kernel, hc_post_kernel, hc_pre_kernel
from deepinfer.neuron_ops.nki.kernels.index_scores import index_scores_kernel
from deepinfer.neuron_ops.nki.kernels.sink_attention import sink_attention_kernel
from deepinfer.neuron_ops.nki.ops import _hbm, _run, _torch


@ops.wrapper("sink_attention")
def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float,
                   *, p_bf16: Optional[bool] = None) -> torch.Tensor:
    """[T, H, D] in q's dtype. P is rounded to bf16 before P.V unless the model runs fp32
    (`p_bf16` overrides: True applies the bf16 rule to fp32 inputs too)."""
    if p_bf16 is None:
        p_bf16 = q.dtype != torch.float32
    h = q.shape[1]
    out = _run(sink_attention_kernel, 1, _hbm(q.contiguous()), _hbm(keys.contiguous()),
               _hbm(valid.to(torch.uint8)), _hbm(sink.float().reshape(h, 1)), float(scale), bool(p_bf16))
    return _torch(out)


@ops.wrapper("index_scores")
def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                 key_scale: float = 1.0) -> torch.Tensor:
    t, heads, _ = q.shape
    if keys.dim() == 2:   # a shared scope: the kernel reads per-row keys, so each row gets a copy
        keys = keys.expand(t, *keys.shape)
    out = _run(index_scores_kernel, 1, _hbm(q.contiguous()), _hbm(keys.contiguous()),
               _hbm(weights.float().reshape(t, heads, 1)), _hbm(valid.to(torch.uint8)), float(key_scale))
    return _torch(out)


def _fn_partition_major(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, K] -> [128, ceil(K/128), M] with [p, c, :] = fn[:, c*128 + p] (zeros past K): the
    projection's moving operand for every K tile in one load (what a weight load would store)."""
    mix, k = fn.shape
    chunks = -(-k // K_TILE)
    padded = torch.zeros(chunks * K_TILE, mix, dtype=torch.float32)
    padded[:k] = fn.float().t()
    return padded.view(chunks, K_TILE, mix).permute(1, 0, 2).contiguous()


@ops.wrapper("hc_mixes")
def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
             hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, dim = x.shape
    pre, post, comb = _run(hc_mixes_kernel, 1, _hbm(x.reshape(t, n * dim).contiguous()), _hbm(_fn_partition_major(fn)),
                           _hbm(base.float().reshape(1, -1)), _hbm(scale.float().reshape(1, -1)), float(norm_eps),
                           float(hc_eps), int(iters))
    return _torch(pre), _torch(post), _torch(comb).view(t, n, n)


@ops.wrapper("hc_pre")
def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return _torch(_run(hc_pre_kernel, 1, _hbm(x.contiguous()), _hbm(pre.float().contiguous())))


@ops.wrapper("hc_post")
def hc_post(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, n, _ = x.shape
    return _torch(_run(hc_post_kernel, 1, _hbm(x.contiguous()), _hbm(y.contiguous()), _hbm(post.float().contiguous()),
                       _hbm(comb.float().reshape(t, n * n))))


# kernel name -> torch wrapper with the reference's arguments (part of nki/registry.py IMPLEMENTED)
WRAPPERS: dict[str, Callable] = {
    "sink_attention": sink_attention,
    "index_scores": index_scores,
    "hc_mixes": hc_mixes,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
}

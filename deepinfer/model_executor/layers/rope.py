"""Interleaved partial RoPE on the trailing `rope_dim` channels (docs/model.md §3.3).

Pairs are (x[2i], x[2i+1]) of the rope slice; YaRN only changes the inverse frequencies
(mscale = 1, so cos/sin are never scaled)."""
import math

import torch


def rope_inv_freq(rope_dim: int, base: float, yarn: dict | None = None) -> torch.Tensor:
    """Host (cpu) table, also when the model is built under a meta device context (build_model):
    cos_sin copies it to each device it meets."""
    theta = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu") / rope_dim))
    if not yarn:
        return theta.float()
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])

    def corr(rot: float) -> float:
        return rope_dim * math.log(orig / (2 * math.pi * rot)) / (2 * math.log(base))

    lo = max(math.floor(corr(float(yarn.get("beta_fast", 32)))), 0)
    hi = min(math.ceil(corr(float(yarn.get("beta_slow", 1)))), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    i = torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu")
    ramp = ((i - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1 -> original frequency (extrapolation), 0 -> interpolated
    return (theta / factor * (1 - keep) + theta * keep).float()


class RotaryEmbedding:
    """cos/sin tables for one (base, yarn) setting, computed on demand for arbitrary positions."""

    def __init__(self, rope_dim: int, base: float, yarn: dict | None = None):
        self.rope_dim = rope_dim
        self.inv_freq = rope_inv_freq(rope_dim, base, yarn)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One copy per device, made on first use: a host-to-device copy inside every forward would be
        # a sync, which a CUDA graph capture refuses (graph runners warm up before capturing).
        inv = self._inv_freq_on.get(positions.device)
        if inv is None:
            inv = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        # fp32 angles: positions * inv_freq, like the references (keeps parity with TF's fp32 path)
        freqs = positions.to(torch.float32)[..., None] * inv
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x. cos/sin: [..., r/2] broadcastable to x[..., :r/2]
    with any head dims inserted by the caller (x: [T, (H,) d], cos: [T, (1,) r/2])."""
    r = cos.shape[-1] * 2
    d = x.shape[-1]
    rope = x[..., d - r:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    if inverse:
        sin = -sin
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rotated = torch.stack((ra, rb), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : d - r], rotated], dim=-1)

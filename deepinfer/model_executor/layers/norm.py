"""RMSNorm in fp32 (docs/model.md notation RMS / RMS_w)."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS_w(x): normalise over the last dim in fp32, scale by `weight` in fp32, cast back once."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)

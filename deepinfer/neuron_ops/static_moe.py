"""Fixed-shape routed experts for the Neuron platform ("moe_experts" kernel, design.md §5.5).

The CPU reference (layers/moe.py `routed_experts`) groups tokens per expert with bincount and
`.tolist()`: data-dependent shapes and a host sync, which a Neuron graph cannot hold (neuron.md B1,
§5.4). Here every local expert runs on every row ("dense local experts", the simple form of §5.5)
and a [T, E] combine matrix, scattered from the top-k, weights the results: the shapes depend only on
T and E. Same argument list and output contract as the reference; same rounding points (expert
outputs in x's dtype, weighted sum in fp32, one cast at the end).
"""
import torch

from deepinfer.model_executor.layers.moe import swiglu


def combine_weights(idx: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[T, E] fp32: row t holds weights[t, j] at column idx[t, j] (scatter-add: duplicates add up)."""
    t = idx.shape[0]
    comb = torch.zeros(t, n_experts, dtype=torch.float32, device=weights.device)
    return comb.scatter_add(1, idx.long(), weights.float())


def static_moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [T, D]; idx, weights: [T, k]; w13: [E, 2I, D] (gate rows first); w2: [E, D, I]. -> [T, D]."""
    n_experts, inter = w13.shape[0], w2.shape[2]
    comb = combine_weights(idx, weights, n_experts)                 # [T, E]
    gu = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))          # [E, T, 2I] in x's dtype
    h = swiglu(gu[..., :inter], gu[..., inter:], limit)
    y = torch.matmul(h, w2.transpose(1, 2))                         # [E, T, D]
    out = (comb.t().unsqueeze(-1) * y.float()).sum(dim=0)
    return out.to(x.dtype)

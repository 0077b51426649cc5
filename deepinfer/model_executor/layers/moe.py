"""MoE routing and SwiGLU experts (docs/model.md §3.6)."""
import torch
import torch.nn.functional as F


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, topk: int,
          scaling: float, hashed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (expert ids [T, k], weights [T, k] fp32). sqrtsoftplus scores; selection by the top-k of
    score + bias (stable: ties to the lower expert) or by the hash table; weights from unbiased scores."""
    logits = x.float() @ gate_w.float().t()
    scores = torch.sqrt(F.softplus(logits))
    if hashed_ids is not None:
        idx = hashed_ids.long()
    else:
        sel = scores + bias.float() if bias is not None else scores
        idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling
    return idx, w


def swiglu(a: torch.Tensor, b: torch.Tensor, limit: float) -> torch.Tensor:
    return (F.silu(a.float().clamp(max=limit)) * b.float().clamp(-limit, limit)).to(a.dtype)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    return swiglu(x @ w1.t(), x @ w3.t(), limit) @ w2.t()


# Up to this many experts, one padded batched GEMM over all experts beats a Python loop over them
# while the experts get few rows each; from LOOPED_MIN_ROWS_PER_EXPERT (T * k / E) on, the loop wins:
# the padded batch is E x (the busiest expert's rows), about 2-3x the routed rows under real routing
# imbalance. Measured, one thread (fp32, D 256, I 128): E 8 k 2, T 2048 25.0 -> 7.2 ms, T 128 1.04 ->
# 0.86, T 48 0.47 vs 0.56 (grouped faster); E 64 k 6, T 2048 77.9 -> 27.4, T 256 8.1 -> 6.0, T 128
# 3.9 vs 4.3 (grouped faster). The two forms round alike (the same expert GEMMs and combine order; bit
# equal at E = 8 in those runs, within 5e-7 at E = 64).
_GROUPED_MAX_EXPERTS = 64
LOOPED_MIN_ROWS_PER_EXPERT = 16


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [T, D]; w13: [E, 2I, D] (gate rows first); w2: [E, D, I]; idx/weights: [T, k]."""
    n_exp = w13.shape[0]
    # under autograd (examples/train_tiny.py) the grouped form stays: its backward sums the gradients
    # in the order the committed trained artifact was made with (docs/tiny_language.md §6)
    many_rows = idx.numel() >= LOOPED_MIN_ROWS_PER_EXPERT * n_exp and not (torch.is_grad_enabled()
                                                                              and x.requires_grad)
    if n_exp <= _GROUPED_MAX_EXPERTS and not many_rows:
        return _grouped_experts(x, idx, weights, w13, w2, limit)
    return _looped_experts(x, idx, weights, w13, w2, limit)


def _grouped_experts(x, idx, weights, w13, w2, limit):
    """Pack each expert's tokens into a [E, C, D] batch (C = the largest expert load), run two bmms."""
    t, dim = x.shape
    n_exp, k = w13.shape[0], idx.shape[1]
    flat_e = idx.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=n_exp)
    cap = int(counts.max()) if flat_e.numel() else 0
    if cap == 0:
        return torch.zeros_like(x)
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = flat_e[order]
    slot = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
    packed = x.new_zeros(n_exp, cap, dim)
    tok = order // k
    packed[sorted_e, slot] = x[tok]
    inter = w2.shape[2]
    gu = torch.bmm(packed, w13.transpose(1, 2))
    y = torch.bmm(swiglu(gu[..., :inter], gu[..., inter:], limit), w2.transpose(1, 2))
    contrib = y[sorted_e, slot].float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(t, dim, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, contrib)
    return out.to(x.dtype)


def _looped_experts(x, idx, weights, w13, w2, limit):
    return looped_experts(x, idx, weights, w13.shape[0], lambda e: (w13[e], w2[e]), limit)


def looped_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, n_experts: int,
                   expert_weights, limit: float) -> torch.Tensor:
    """Each expert that got tokens runs on its rows only. expert_weights(e) -> (w13 [2I, D], w2 [D, I])
    in x's dtype: stacked dense weights, or a packed expert dequantized for this call
    (layers/quant_gemm.py). The routing's counts reach the host, so this form is eager only."""
    t, dim = x.shape
    out = torch.zeros(t, dim, dtype=torch.float32, device=x.device)
    flat_e = idx.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=n_experts).tolist()
    tok = (order // idx.shape[1])
    wts = weights.reshape(-1)[order]
    pos = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tok[pos:pos + n]
        w13_e, w2_e = expert_weights(e)
        inter = w2_e.shape[1]
        gu = x[rows] @ w13_e.t()
        y = swiglu(gu[:, :inter], gu[:, inter:], limit) @ w2_e.t()
        out.index_add_(0, rows, y.float() * wts[pos:pos + n, None])
        pos += n
    return out.to(x.dtype)


# -- fixed-shape routed experts ---------------------------------------------------------------------
# The forms above size their work from the routing (bincount, `.tolist()`, a capacity from
# `counts.max()`): host syncs and data-dependent shapes, which neither a captured CUDA graph nor a
# Neuron graph can hold. The forms below depend only on (T, k, E): same argument list, same output
# contract, same rounding points (expert outputs in x's dtype, weighted sum in fp32, one final cast).

def combine_weights(idx: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[T, E] fp32: row t holds weights[t, j] at column idx[t, j] (scatter-add: duplicates add up)."""
    comb = torch.zeros(idx.shape[0], n_experts, dtype=torch.float32, device=weights.device)
    return comb.scatter_add(1, idx.long(), weights.float())


def dense_local_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Every expert on every row, weighted by a [T, E] combine matrix (Neuron's form, docs/neuron.md §5.5):
    E/k times the FLOPs of the routed work, but plain batched GEMMs any backend compiles."""
    n_experts, inter = w13.shape[0], w2.shape[2]
    comb = combine_weights(idx, weights, n_experts)                 # [T, E]
    gu = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))          # [E, T, 2I] in x's dtype
    h = swiglu(gu[..., :inter], gu[..., inter:], limit)
    y = torch.matmul(h, w2.transpose(1, 2))                         # [E, T, D]
    out = (comb.t().unsqueeze(-1) * y.float()).sum(dim=0)
    return out.to(x.dtype)


def grouped_static_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed work only: the T*k (token, expert) rows sorted by expert, one grouped GEMM per
    projection with the group ends computed on the device (`torch._grouped_mm`, bf16), so no count
    ever reaches the host."""
    t, k = idx.shape
    n_experts, inter = w13.shape[0], w2.shape[2]
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // k]                                            # [T*k, D]
    gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)    # [T*k, 2I]
    h = swiglu(gu[:, :inter], gu[:, inter:], limit)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)         # [T*k, D]
    contrib = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    contrib[order] = y.float() * weights.reshape(-1)[order, None].float()
    return contrib.view(t, k, -1).sum(dim=1).to(x.dtype)


def static_routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Fixed-shape routed experts: grouped GEMMs where torch has them for x's dtype (bf16), else the
    dense form."""
    if x.dtype == torch.bfloat16 and w13.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return grouped_static_experts(x, idx, weights, w13, w2, limit)
    return dense_local_experts(x, idx, weights, w13, w2, limit)


# -- fixed-shape active experts ---------------------------------------------------------------------
# A decode step routes T*k pairs over E experts; with T*k << E most held experts get no pair, and the
# forms above still read all of their weights. The form below reads only the experts hit by at least
# one pair: a compacted list of their ids with a static length S = min(E, T*k) and a runtime count,
# and a loop over the S slots whose slot j runs (gathers expert ids[j]'s weights, computes, adds) only
# when j < count. Traced into a graph the guard is a torch.cond (no host sync, no data-dependent
# shape); eager it is a loop over the count. Accumulation matches the all-experts forms: expert
# outputs in x's dtype, weighted and summed in fp32 in ascending expert order (skipping an expert
# whose combine column is all zero adds nothing), one final cast (docs/neuron.md §5.5).

# Expected pairs per expert (rows * top_k / routed experts) from which a fixed-shape step runs every
# held expert instead: by then nearly every expert is hit (P = 1 - e^-1 at 1.0), so the compacted loop
# saves no bytes and only adds its guard per slot (docs/neuron.md §5.5).
ACTIVE_EXPERTS_MAX_LOAD = 1.0


def use_active_experts(rows: int, topk: int, n_experts: int) -> bool:
    """Whether a fixed-shape step of `rows` rows (each routing `topk` pairs over `n_experts` routed
    experts, all ranks together) takes the compacted active-experts form. Python ints only: every
    rank of an EP group decides the same from the same static shapes."""
    return rows * topk < ACTIVE_EXPERTS_MAX_LOAD * n_experts


def active_expert_slots(idx: torch.Tensor, weights: torch.Tensor, n_experts: int):
    """(ids [S] int64, count 0-dim int64) with S = min(n_experts, idx.numel()): the experts holding at
    least one pair of non-zero weight, ascending, then n_experts (no expert) in the unused slots. A
    pair of zero weight (another rank's pair, a placeholder row) hits nothing."""
    slots = min(n_experts, idx.numel())
    target = torch.where(weights != 0, idx.long(), torch.full_like(idx.long(), n_experts))
    hit = torch.zeros(n_experts + 1, dtype=torch.bool, device=idx.device)
    hit = hit.scatter(0, target.reshape(-1), torch.ones_like(target.reshape(-1), dtype=torch.bool))[:n_experts]
    count = hit.sum()
    order = torch.argsort((~hit).to(torch.uint8), stable=True)      # hit experts first, ascending
    used = torch.arange(n_experts, device=idx.device) < count
    ids = torch.where(used, order, torch.full_like(order, n_experts))
    return ids[:slots], count


def active_slot_sum(x: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, comb: torch.Tensor,
                    expert_out) -> torch.Tensor:
    """fp32 [T, D]: sum over slots j < count of comb[:, ids[j]] * expert_out(ids[j:j+1]).
    expert_out(e) -> [T, D] in x's dtype; it must read only expert e's weights (index_select by e).
    On meta tensors (the dry run: no values) every slot runs, the worst case."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)

    def add(out, e):
        return out + comb.index_select(1, e) * expert_out(e).float()
    if x.is_meta:
        for j in range(ids.shape[0]):
            out = add(out, ids[j:j + 1])
        return out
    if not torch.compiler.is_compiling():
        for j in range(int(count)):   # eager: the runtime count read on the host
            out = add(out, ids[j:j + 1])
        return out
    for j in range(ids.shape[0]):
        out = torch.cond(count > j, add, lambda out, e: out.clone(), (out, ids[j:j + 1]))
    return out


def active_local_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, limit: float) -> torch.Tensor:
    """The fixed-shape form of `routed_experts` that reads only the hit experts' weights (see above);
    same arguments and rounding points as `dense_local_experts`. CUDA graphs capture no runtime count,
    so on CUDA it is `static_routed_experts`."""
    if x.is_cuda:
        return static_routed_experts(x, idx, weights, w13, w2, limit)
    n_experts, inter = w13.shape[0], w2.shape[2]
    comb = combine_weights(idx, weights, n_experts)
    ids, count = active_expert_slots(idx, weights, n_experts)

    def expert_out(e):
        gu = x @ expert_weight_t(w13, e)
        return swiglu(gu[:, :inter], gu[:, inter:], limit) @ expert_weight_t(w2, e)
    return active_slot_sum(x, ids, count, comb, expert_out).to(x.dtype)


def expert_weight_t(w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """w[e].t() ([in, out]) for a stack w [E, out, in] and a one-element id tensor e, gathered in the
    stack's memory order. A compiled graph lays the gathered copy out contiguously in the order its
    logical shape is written: `w.index_select(0, e)[0].t()` on the fp32 stacks, held [in, out] in
    memory (v4_ffn.pack), became a transposing copy; gathering the [in, out] view is a plain one.
    Measured on this project's CPU (one thread, tiny V4, 256 x 256 gate/up experts): the gather kernel
    of a batch-1 compiled step took 93-133 us a layer before and 60-75 us after (torch.profiler); the
    gather and its GEMM compiled alone, hot in cache, 45 -> 30 us. Same values, and the GEMM then reads
    the operand in the layout the eager loop reads it (bit-equal to it)."""
    if w.stride(-2) == 1:   # held transposed: [E, in, out] in memory
        return w.transpose(1, 2).index_select(0, e)[0]
    return w.index_select(0, e)[0].t()

"""One fp4 projection of the routed experts a step hit, over a compacted id list: slot j < count
computes x_j @ W[ids[j]]^T with the tiles of `blockquant_fp4_gemm` (kernels/blockquant_fp4_gemm.py).

Design note. A decode step hits few of a rank's experts (docs/neuron.md §5.5), so the kernel reads
only theirs: the router side compacts the hit experts' ids into a list of static length S = min(E,
T*k) and a runtime count; a hardware loop (`nl.dynamic_range` over a register loaded from the count)
runs once per hit expert, and each iteration loads that expert's id from HBM into a register and
DMAs its weight and scale tiles at the register's offset into the stacked [E, ...] weights. An
expert without a pair is never addressed, so its bytes never leave HBM; slots past the count are
not written (the caller reads only slots below the count). The loop body is one copy, not unrolled,
so its tiles do not pipeline across experts the way a static loop over all experts can: for steps
that hit most experts the all-experts form stays (layers/moe.py ACTIVE_EXPERTS_MAX_LOAD).

Layout (prepared by ops.fp4_active_experts): x_lo, x_hi [Sx, M, K/2] the even / odd K columns of the
rows (Sx = 1: the same rows for every slot, the gate/up projection; Sx = S: slot j's own rows, the
down projection of its SwiGLU output); w_t [E, K/2, N] and s_t [E, K/g, N] K-major; onehot as in
blockquant_fp4_gemm; ids [S, 1, 1] int32; count [1, 1] int32. Output [S, M, N] in x's dtype; grid 2
splits N."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl
from deepinfer.neuron_ops.nki.kernels.blockquant_fp4_gemm import N_TILE, fp4_tile_matmul, row_chunks


@nki.jit
def fp4_active_experts_kernel(x_lo, x_hi, w_t, s_t, onehot_in, ids, count, group):
    shared_rows = x_lo.shape[0] == 1
    slots, m, kb = ids.shape[0], x_lo.shape[1], x_lo.shape[2]
    n = w_t.shape[2]
    out = nl.ndarray((slots, m, n), dtype=x_lo.dtype, buffer=nl.shared_hbm)
    share = -(-n // nl.num_programs(0))
    n_lo = nl.program_id(0) * share
    n_hi = min(n, n_lo + share)
    onehot = nl.load(onehot_in)
    n_active = nisa.register_alloc()
    nisa.register_load(n_active, nl.load(count))
    if shared_rows:
        chunks = row_chunks(x_lo[0], x_hi[0], kb)
    for j in nl.dynamic_range(n_active):
        id_tile = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=id_tile, src=ids[j])
        expert = nisa.register_alloc()
        nisa.register_load(expert, id_tile)
        if not shared_rows:
            chunks = row_chunks(x_lo[j], x_hi[j], kb)
        for n0 in nl.static_range(n_lo, n_hi, N_TILE):
            nt = min(N_TILE, n_hi - n0)
            accs = fp4_tile_matmul(chunks, w_t[expert], s_t[expert], onehot, group, n0, nt, x_lo.dtype)
            for acc, (r0, r1, _, _) in zip(accs, chunks):
                nl.store(out[j, r0:r1, n0:n0 + nt], nisa.activation(nl.copy, acc, dtype=x_lo.dtype))
    return out

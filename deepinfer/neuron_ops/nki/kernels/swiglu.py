"""SwiGLU with the clamp limit: silu(min(gate, limit)) * clamp(up, -limit, limit), fp32 math,
rows on partitions, the free axis in chunks of FREE_CHUNK columns."""
from deepinfer.neuron_ops.nki.api import nisa, nki, nl

# Columns per tile: 2 inputs + 3 fp32 temporaries of 2048 columns = 40 KiB per partition.
FREE_CHUNK = 2048


@nki.jit
def swiglu_kernel(gate, up, limit):
    """gate, up: [M, I] HBM; limit: float. Returns [M, I] in gate's dtype."""
    m, width = gate.shape
    out = nl.ndarray((m, width), dtype=gate.dtype, buffer=nl.shared_hbm)
    pmax = nl.tile_size.pmax
    for t in nl.static_range((m + pmax - 1) // pmax):
        r0 = t * pmax
        rows = min(pmax, m - r0)
        for c in nl.static_range((width + FREE_CHUNK - 1) // FREE_CHUNK):
            c0 = c * FREE_CHUNK
            cols = min(FREE_CHUNK, width - c0)
            g = nl.load(gate[r0:r0 + rows, c0:c0 + cols])
            u = nl.load(up[r0:r0 + rows, c0:c0 + cols])
            g_clamped = nisa.tensor_scalar(g, nl.minimum, limit, dtype=nl.float32)
            g_act = nisa.activation(op=nl.silu, data=g_clamped, dtype=nl.float32)
            u_clamped = nisa.tensor_scalar(u, nl.maximum, -limit, op1=nl.minimum, operand1=limit,
                                           dtype=nl.float32)
            y = nisa.tensor_tensor(g_act, u_clamped, nl.multiply, dtype=gate.dtype)
            nl.store(out[r0:r0 + rows, c0:c0 + cols], y)
    return out

"""Small argument sets for every Neuron kernel (host tests and the device tier share them)."""
import torch

from deepinfer.model_executor.layers import quant

g = torch.Generator().manual_seed(0)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _valid(t, k):
    v = torch.rand(t, k, generator=g) > 0.3
    v[:, 0] = True
    return v


def kernel_args():
    t, n, d, h, e = 5, 4, 32, 3, 7
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])
    w8, s8 = quant.quantize_fp8_block(rnd(24, 64), (8, 16))
    w4, s4 = quant.quantize_fp4(rnd(24, 64), 32)
    e13, e13s = quant.quantize_fp4(rnd(6, 64, d) * 0.2, 32)      # 6 packed experts: [E, 2I, D/2], I = 32
    e2, e2s = quant.quantize_fp4(rnd(6, d, 32) * 0.2, 32)
    moe_packed = (rnd(t, d), idx, torch.rand(t, 2, generator=g), e13.view(torch.uint8), e13s.view(torch.uint8),
                  e2.view(torch.uint8), e2s.view(torch.uint8))
    table, table_s = quant.quantize_fp8_block(rnd(10, d), (1, 16))
    rows = torch.tensor([[0, 3], [-1, 9], [2, 2], [5, -1], [7, 1]])
    return {
        "rms_norm": ((rnd(t, d), rnd(d), 1e-6), {}),
        "rope": ((rnd(t, h, d), rnd(t, 1, 8), rnd(t, 1, 8)), {"inverse": True}),
        "hc_mixes": ((rnd(t, n, d), rnd(24, n * d) * 0.1, rnd(24), rnd(3), 1e-6, 1e-6, 5), {}),
        "hc_pre": ((rnd(t, n, d), torch.rand(t, n, generator=g)), {}),
        "hc_post": ((rnd(t, n, d), rnd(t, d), torch.rand(t, n, generator=g), torch.rand(t, n, n, generator=g)), {}),
        "hc_head": ((rnd(t, n, d), rnd(n, n * d) * 0.1, rnd(n), rnd(1), 1e-6, 1e-6), {}),
        "sink_attention": ((rnd(t, h, d), rnd(t, e, d), _valid(t, e), rnd(h), d ** -0.5), {}),
        "index_scores": ((rnd(t, h, d), rnd(t, e, d), rnd(t, h), _valid(t, e)), {"key_scale": 0.25}),
        "compress_pool": ((rnd(e, 4, d), rnd(e, 4, d), _valid(e, 4)), {}),
        "moe_experts": ((rnd(t, d), idx, torch.rand(t, 2, generator=g), rnd(6, 16, d) * 0.2, rnd(6, d, 8) * 0.2,
                         10.0), {}),
        "moe_experts_static": ((rnd(t, d), idx, torch.rand(t, 2, generator=g), rnd(6, 16, d) * 0.2,
                                rnd(6, d, 8) * 0.2, 10.0), {}),
        "moe_experts_active": ((rnd(t, d), idx, torch.rand(t, 2, generator=g), rnd(6, 16, d) * 0.2,
                                rnd(6, d, 8) * 0.2, 10.0), {}),
        "expert_mlp": ((rnd(t, d), rnd(8, d), rnd(8, d), rnd(d, 8), 10.0), {}),
        "engram_gate": ((rnd(t, n, d), rnd(t, (n + 1) * d), rnd(n, d), rnd(n, d), 1e-6), {}),
        "swiglu": ((rnd(t, 8) * 6, rnd(t, 8) * 6, 7.0), {}),
        "blockquant_fp8_gemm": ((rnd(t, 64), w8.view(torch.uint8), s8.view(torch.uint8), 8, 16), {}),
        "blockquant_fp4_gemm": ((rnd(t, 64), w4.view(torch.uint8), s4.view(torch.uint8), 32), {}),
        "blockquant_fp8_grouped_gemm": ((rnd(t, 2, 64), w8.view(torch.uint8), s8.view(torch.uint8), 8, 16), {}),
        "fp4_routed_experts": (moe_packed + (32, 10.0), {}),
        "fp4_static_experts": (moe_packed + (32, 10.0), {}),
        "fp4_active_experts": (moe_packed + (32, 10.0), {}),
        "fp8_table_rows": ((table.view(torch.uint8), table_s.view(torch.uint8), rows, 16, torch.float32), {}),
    }




def kernel_case(name: str):
    return kernel_args()[name]

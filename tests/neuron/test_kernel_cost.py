"""The interpreter's kernel cost model (interpreter/cost.py): per-instruction costs, the overlap
rule, the tile extrapolation the kernel report uses, and the calibration of a seed-design kernel
against the seed's measured trn2 time (an external measurement, docs/neuron.md section 1.1)."""
import pytest
import torch

from deepinfer.neuron_ops.nki import ops
from deepinfer.neuron_ops.nki.interpreter import cost, dtypes
from deepinfer.neuron_ops.nki.interpreter.tensor import Tensor
from deepinfer.tools import kernel_report


class _T:
    def __init__(self, shape, dtype, buffer="sbuf"):
        self.shape, self.dtype, self.buffer = shape, dtype, buffer


def test_vector_costs_follow_the_isa_formulas():
    assert cost.elementwise_cycles(512) == 512                       # one input: N
    assert cost.elementwise_cycles(512, inputs=2) == 1024            # two SBUF inputs: 2N
    assert cost.elementwise_cycles(512, inputs=2, psum_input=True) == 512
    assert cost.elementwise_cycles(32) == 64 + 100                   # MIN_II and the small-N overhead
    assert cost.elementwise_cycles(512, speedup=4) == 128
    bf = _T((128, 512), dtypes.bfloat16)
    assert cost.perf_mode_speedup(bf, dtypes.bfloat16) == 4
    assert cost.perf_mode_speedup(_T((128, 512), dtypes.bfloat16, "psum"), dtypes.bfloat16) == 2
    assert cost.perf_mode_speedup(_T((128, 512), dtypes.float8_e4m3), dtypes.bfloat16) == 1
    assert cost.gpsimd_cycles(10) == 160


def test_tensor_engine_costs():
    s, mv = _T((128, 128), dtypes.bfloat16), _T((128, 512), dtypes.float8_e4m3)
    assert cost.matmul_cycles(s, mv) == 512
    assert cost.matmul_cycles(_T((128, 1), dtypes.bfloat16), _T((128, 1), dtypes.bfloat16)) == 1
    assert cost.matmul_cycles(_T((128, 16), dtypes.bfloat16), _T((128, 8), dtypes.bfloat16)) == 16
    assert cost.matmul_cycles(_T((128, 128), dtypes.float32), mv) == 4 * 512
    assert cost.tensor_transpose_cycles((1, 128)) == 64 and cost.tensor_transpose_cycles((128, 1)) == 128
    assert cost.seconds("tensor", 2.4e9) == 1.0 and cost.seconds("vector", 0.96e9) == 1.0


def test_dma_time_is_bytes_or_descriptor_issue():
    assert cost.dma_seconds(2.9e12 / 8, 1) == pytest.approx(1.0)
    assert cost.dma_seconds(0, 10) == pytest.approx(10 * 600e-9 / 2)
    t = cost.program_seconds({"vector": 2e-6, "tensor": 1e-6}, 0, 1)
    assert t["total"] == 2e-6 and t["dma"] == pytest.approx(300e-9)


def test_a_launch_takes_its_slowest_program_and_its_busiest_engine():
    codes = torch.randint(0, 120, (2048, 256), dtype=torch.uint8)
    scale = torch.full((64, 8), 127, dtype=torch.uint8)
    x = torch.randn(1, 256).bfloat16()
    ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, grid=1, design="seed")
    one = ops.last_stats()
    ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, grid=2, design="seed")
    two = ops.last_stats()
    assert one.predicted_s == max(one.engine_s.values()) > 0
    assert two.predicted_s == pytest.approx(one.predicted_s / 2, rel=0.1)   # the N halves run at once
    assert two.instructions["vector"] == one.instructions["vector"] + 256 // 128   # each program copies x^T


def test_tile_extrapolation_equals_the_direct_run():
    make = kernel_report._fp8_thunk(1, 256, "seed")
    direct = kernel_report._engine_seconds(make(5 * 1024 + 320))
    got = kernel_report.predicted_seconds(make, 5 * 1024 + 320, kernel_report.N_STEP)
    for e, v in direct.items():
        assert got[e] == pytest.approx(v, rel=1e-9, abs=1e-12), e


def test_seed_design_fp8_predicts_the_seed_measurement_and_the_tensor_design_meets_its_target():
    m, k, n = 1, 1280, 36864
    seed = kernel_report.predicted_seconds(kernel_report._fp8_thunk(m, k, "seed"), n, kernel_report.N_STEP)
    measured = kernel_report.SEED_MS[("blockquant_fp8_gemm", m, k, n)] * 1e-3
    assert abs(seed["total"] / measured - 1) <= 0.35
    now = kernel_report.predicted_seconds(kernel_report._fp8_thunk(m, k, "auto"), n, kernel_report.N_STEP)
    roof = kernel_report.roofline_seconds(m, k, n, n * k * (1 + 1 / 32))
    assert now["total"] <= 2 * roof
    assert now["vector"] < seed["vector"] / 10

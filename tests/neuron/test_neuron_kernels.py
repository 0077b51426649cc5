"""Neuron kernel table: every host kernel (custom op) equals its reference and its fake shape
function matches (opcheck); both MoE names are the fixed-shape form; blockquant GEMMs; trn2 fp8; device
mode runs the plain references (no NKI kernel is written)."""
import pytest
import torch

from deepinfer.model_executor.layers import moe, quant
from deepinfer.neuron_ops import fp8, kernel_routing, refs
from tests.support.neuron_cases import kernel_args, rnd

ARGS = kernel_args()


def test_every_kernel_has_a_case():
    assert set(ARGS) == set(kernel_routing.KERNEL_NAMES)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_host_kernel_equals_reference_and_fake(name):
    args, kw = ARGS[name]
    op = kernel_routing.kernel(name)
    got, want = op(*args, **kw), kernel_routing.reference(name)(*args, **kw)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
        assert a.dtype == b.dtype and torch.equal(a, b)
    torch.library.opcheck(op, args, kw, test_utils=("test_schema", "test_faketensor"))


def test_model_kernels_keep_the_cpu_references():
    from deepinfer.model_executor.layers.kernel_table import reference
    for name in ("rms_norm", "sink_attention", "hc_mixes", "index_scores", "expert_mlp"):
        args, kw = ARGS[name]
        a, b = kernel_routing.reference(name)(*args, **kw), reference(name)(*args, **kw)
        for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a, b))):
            assert torch.equal(x, y)


def test_every_moe_name_is_the_fixed_shape_form():
    args, _ = ARGS["moe_experts"]
    want = moe.dense_local_experts(*args)
    for name in ("moe_experts", "moe_experts_static"):
        assert torch.equal(kernel_routing.reference(name)(*args), want)


def test_blockquant_references_match_dequantized_matmul():
    x = rnd(3, 64)
    w = rnd(24, 64)
    q, s = quant.quantize_fp8_block(w, (8, 16))
    got = kernel_routing.reference("blockquant_fp8_gemm")(x, q.view(torch.uint8), s.view(torch.uint8), 8, 16)
    assert torch.allclose(got, x @ quant.dequant_fp8_block(q, s, (8, 16)).t(), atol=1e-5)
    q4, s4 = quant.quantize_fp4(w, 32)
    got4 = kernel_routing.reference("blockquant_fp4_gemm")(x, q4.view(torch.uint8), s4.view(torch.uint8), 32)
    assert torch.allclose(got4, x @ quant.dequant_fp4(q4, s4, 32).t(), atol=1e-5)
    with pytest.raises(ValueError, match="w_codes: expected uint8"):
        kernel_routing.reference("blockquant_fp8_gemm")(x, q, s, 8, 16)


def test_trn2_weight_rescale_keeps_values():
    w = rnd(64, 64) * 3
    q, s = quant.quantize_fp8_block(w, (32, 32))
    q2, s2 = fp8.rescale_weight_for_trn2(q, s)
    assert q2.dtype == torch.uint8 and fp8.trn2_representable(q2)
    before = quant.dequant_fp8_block(q, s, (32, 32))
    after = quant.dequant_fp8_block(q2.view(torch.float8_e4m3fn), s2.view(torch.float8_e8m0fnu), (32, 32))
    bad = torch.isin(q.view(torch.uint8), fp8.inexact_codes())
    assert torch.equal(before[~bad], after[~bad])
    # only the two lowest binades (|v| < 2^-5) are inexact, and only by rounding
    lost = q.view(torch.float8_e4m3fn).float()[bad].abs()
    assert (lost < 2 ** -5).all()
    codes = fp8.inexact_codes().view(torch.float8_e4m3fn).float().abs()
    assert len(codes) > 0 and (codes < 2 ** -5).all()
    with pytest.raises(ValueError, match="254"):
        fp8.rescale_weight_for_trn2(q, torch.full_like(s.view(torch.uint8), 254))


def test_activation_quantization_stays_below_224():
    x = rnd(4, 256) * 50
    codes, scale = fp8.quantize_activation(x, block=128)
    v = codes.view(torch.float8_e4m3fn).float()
    assert v.abs().max().item() <= fp8.ACT_FP8_MAX and fp8.trn2_representable(codes)
    back = fp8.dequantize_activation(codes, scale, block=128)
    assert ((back - x).abs() <= x.abs() * 2 ** -3 + 1e-3).all()
    with pytest.raises(ValueError, match="240"):
        fp8.quantize_activation(x, fp8_max=448.0)


def test_device_mode_runs_the_plain_references():
    # Every name, planned NKI kernel or not, is the reference traced into the region graph.
    for name in kernel_routing.KERNEL_NAMES:
        assert kernel_routing.kernel(name, on_device=True) is kernel_routing.reference(name)
        assert kernel_routing.kernel(name, on_device=False) is not kernel_routing.reference(name)   # the custom op
    assert kernel_routing.kernel("moe_experts_static", on_device=True) is refs.PLAIN["moe_experts"]


def test_planned_nki_kernels_name_table_entries():
    assert kernel_routing.NKI_KERNELS and set(kernel_routing.NKI_KERNELS) <= set(kernel_routing.KERNEL_NAMES)
    from deepinfer.neuron_ops.nki.registry import IMPLEMENTED
    assert set(kernel_routing.NKI_KERNELS) <= set(IMPLEMENTED)   # every described kernel is written
    with pytest.raises(ValueError, match="unknown name"):
        kernel_routing.kernel("flash_attention")

"""Packed weights in the NKI kernels' layouts, made once at load (model_executor/layers/kernel_layouts.py):
the layouts round-trip to the checkpoint's codes and exponents, the kernels equal their references on
them in the interpreter, a wrapper call hands the stored tensors to the kernel without one layout op
on them (against a negative control: the checkpoint layout, laid out per call), the fp8 range check
runs once at load and names the tensor, and the bytes stay what the memory report says."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deepinfer.config import ModelConfig
from deepinfer.model_executor.layers import kernel_layouts as kl
from deepinfer.model_executor.layers import quant
from deepinfer.model_executor.layers.packed_weights import PackedFp8Linear, WeightFormat
from deepinfer.neuron_ops import kernel_routing
from deepinfer.neuron_ops.nki import api, ops
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.platforms.neuron.weight_layouts import lay_out_model
from deepinfer.tools import memory_report as mr
from tests.support.gemm_close import gemm_close as _gemm_close

GEN = torch.Generator().manual_seed(11)
pytestmark = pytest.mark.skipif(not api.INTERPRETED, reason="runs the kernels in the NumPy interpreter")


def _fp8_weight(n, k, block=32):
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=GEN)
    codes = torch.where((codes & 0x78) == 0x78, codes & 0xF7, codes)   # within trn2 e4m3 (<= 240)
    scale = torch.randint(118, 130, (-(-n // block), -(-k // block)), dtype=torch.uint8, generator=GEN)
    return codes, scale


def _experts(e=4, dim=256, inter=96):
    q13, s13 = quant.quantize_fp4(torch.randn(e, 2 * inter, dim, generator=GEN) * 0.2, 32)
    q2, s2 = quant.quantize_fp4(torch.randn(e, dim, inter, generator=GEN) * 0.2, 32)
    return tuple(a.view(torch.uint8) for a in (q13, s13, q2, s2))


def _laid_out_experts(w13, s13, w2, s2):
    return (*kl.fp4_experts(w13, s13), *kl.fp4_experts(w2, s2))


# --- the layouts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(700, 256), (1300, 300), (96, 64)])
def test_fp8_layout_is_partition_major_and_round_trips(n, k):
    codes, scale = _fp8_weight(n, k)
    w_p, s_bk = kl.fp8_linear(codes, scale, 32)
    kp = -(-k // 128) * 128
    assert w_p.shape == (128, kp // 128, n) and w_p.is_contiguous() and s_bk.shape == (scale.shape[0], kp)
    t, p = 1 if k > 128 else 0, 5
    assert torch.equal(w_p[p, t], codes[:, 128 * t + p])          # w_p[p, t, n] = W[n, 128 t + p]
    assert torch.equal(s_bk[:, 37].float(), torch.ldexp(torch.ones(scale.shape[0]), scale[:, 1].int() - 127))
    back_codes, back_scale = kl.fp8_checkpoint_view(w_p, s_bk, k, 32)
    assert torch.equal(back_codes, codes) and torch.equal(back_scale, scale)
    assert w_p.numel() + 2 * s_bk.numel() == kl.layout_bytes("fp8", n, k, (32, 32))
    assert kl.fp8_is_kernel_layout(w_p) and not kl.fp8_is_kernel_layout(codes)


def test_fp4_layout_is_k_major_with_the_checkpoint_bytes():
    w13, s13, _, _ = _experts()
    w_t, s_t = kl.fp4_experts(w13, s13)
    assert w_t.shape == (4, 128, 192) and s_t.shape == (4, 8, 192) and w_t.dtype == s_t.dtype == torch.uint8
    assert w_t.numel() + s_t.numel() == w13.numel() + s13.numel()
    assert kl.fp4_is_kernel_layout(w_t, s_t) and not kl.fp4_is_kernel_layout(w13, s13)
    back = kl.fp4_checkpoint_view(w_t, s_t)
    assert torch.equal(back[0], w13) and torch.equal(back[1], s13)
    with pytest.raises(ValueError, match="group of 2"):
        kl.fp4_experts(w13[0], torch.zeros(192, 128, dtype=torch.uint8))


# --- kernels equal their references on the load-time layouts ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 64, 130])
def test_fp8_kernel_on_the_stored_layout(m, dtype):
    codes, scale = _fp8_weight(1300, 300)
    w_p, s_bk = kl.fp8_linear(codes, scale, 32)
    x = torch.randn(m, 300, generator=GEN).to(dtype)
    ref = kernel_routing.reference("blockquant_fp8_gemm")
    want = ref(x, codes, scale, 32, 32)
    assert torch.equal(ref(x, w_p, s_bk, 32, 32), want)                # the reference reads the same weight
    got = ops.blockquant_fp8_gemm(x, w_p, s_bk, 32, 32)
    # the same launches as the checkpoint layout's tensor design, laid out per call
    assert torch.equal(got, ops.blockquant_fp8_gemm(x, codes, scale, 32, 32, design="tensor"))
    assert got.dtype == dtype and _gemm_close(got, want, x, codes, scale)   # up to fp32 summation order
    with pytest.raises(ValueError, match="seed design"):
        ops.blockquant_fp8_gemm(x, w_p, s_bk, 32, 32, design="seed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_kernel_reads_each_group_in_place(dtype):
    groups, rows, k = 3, 96, 160
    codes, scale = _fp8_weight(groups * rows, k)
    w_p, s_bk = kl.fp8_linear(codes, scale, 32)
    x = torch.randn(5, groups, k, generator=GEN).to(dtype)
    got = ops.blockquant_fp8_grouped_gemm(x, w_p, s_bk, 32, 32)
    assert ops.last_stats().launches == groups
    assert torch.equal(got, ops.blockquant_fp8_grouped_gemm(x, codes, scale, 32, 32))
    ref = kernel_routing.reference("blockquant_fp8_grouped_gemm")
    assert torch.equal(ref(x, w_p, s_bk, 32, 32), ref(x, codes, scale, 32, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 9, 130])
def test_fp4_kernels_on_the_stored_layout(m, dtype):
    w13, s13, w2, s2 = _experts()
    laid = _laid_out_experts(w13, s13, w2, s2)
    x = torch.randn(m, 256, generator=GEN).to(dtype) * 0.05
    # one projection: the K-major bytes and exponents as stored
    assert torch.equal(ops.blockquant_fp4_gemm(x, laid[0][1], laid[1][1], 32),
                       ops.blockquant_fp4_gemm(x, w13[1], s13[1], 32))
    assert torch.equal(kernel_routing.reference("blockquant_fp4_gemm")(x, laid[0][1], laid[1][1], 32),
                       kernel_routing.reference("blockquant_fp4_gemm")(x, w13[1], s13[1], 32))
    idx = torch.randint(0, 4, (m, 2), generator=GEN)
    idx[:, 1] = torch.where(idx[:, 1] == 2, 3, idx[:, 1])   # expert 2: hit only through column 0
    weights = torch.rand(m, 2, generator=GEN) + 0.05
    for name in ("fp4_static_experts", "fp4_active_experts"):
        wrapper, ref = getattr(ops, name), kernel_routing.reference(name)
        got = wrapper(x, idx, weights, *laid, 32, 10.0)
        assert torch.equal(got, wrapper(x, idx, weights, w13, s13, w2, s2, 32, 10.0)), name
        want = ref(x, idx, weights, w13, s13, w2, s2, 32, 10.0)
        assert torch.equal(ref(x, idx, weights, *laid, 32, 10.0), want), name
        scale = want.float().abs().max().item()
        assert ((got.float() - want.float()).abs() <= 0.02 * scale + 1e-3).all(), name


@pytest.mark.parametrize("hit", [None, [2], [0, 1, 2, 3]], ids=["none", "one", "every"])
def test_active_experts_on_the_stored_layout_with_none_one_and_every_expert_hit(hit):
    w13, s13, w2, s2 = _experts()
    laid = _laid_out_experts(w13, s13, w2, s2)
    x = torch.randn(7, 256, generator=GEN).bfloat16() * 0.05
    pool = torch.tensor(hit or [1])
    idx = pool[torch.randint(len(pool), (7, 2), generator=GEN)]
    idx[:len(pool), 0] = pool[:7]                          # every expert of the pool gets a row
    weights = torch.rand(7, 2, generator=GEN) + 0.05
    if hit is None:
        weights = torch.zeros_like(weights)
    got = ops.fp4_active_experts(x, idx, weights, *laid, 32, 10.0)
    assert torch.equal(got, ops.fp4_static_experts(x, idx, weights, *laid, 32, 10.0))
    assert torch.equal(got, ops.fp4_active_experts(x, idx, weights, w13, s13, w2, s2, 32, 10.0))
    if hit is None:
        assert torch.equal(got, torch.zeros_like(got))


# --- no layout op per call ---------------------------------------------------------------------------
class _WeightOps(TorchDispatchMode):
    """Records every aten op the wrapper issues on the weights' storage outside the kernel launch
    (`ops._run` marshals the kernel's inputs into the interpreter; that part is not the wrapper's)."""

    def __init__(self, weights):
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.ops, self.kernel_args, self.paused = [], [], False

    def _ours(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and any(self._ours(t) for t in tree_leaves((args, kwargs))):
            # a view that leaves the bytes where they are (e.g. expert e of a stack) is no layout op
            view = isinstance(out, torch.Tensor) and self._ours(out) and out.is_contiguous()
            if not view:
                self.ops.append(str(func))
        return out


def _record(monkeypatch, weights, call):
    mode = _WeightOps(weights)
    run = ops._run

    def launch(kernel, grid, *args):
        mode.kernel_args.extend(a for a in args if isinstance(a, torch.Tensor))
        mode.paused = True
        try:
            return run(kernel, grid, *args)
        finally:
            mode.paused = False
    monkeypatch.setattr(ops, "_run", launch)
    with mode:
        call()
    monkeypatch.setattr(ops, "_run", run)
    return mode


def _calls():
    codes, scale = _fp8_weight(320, 256)
    w_p, s_bk = kl.fp8_linear(codes, scale, 32)
    w13, s13, w2, s2 = _experts()
    laid = _laid_out_experts(w13, s13, w2, s2)
    x, x3 = torch.randn(3, 256, generator=GEN), torch.randn(3, 2, 256, generator=GEN)
    idx, weights = torch.tensor([[0, 2], [2, 3], [0, 3]]), torch.rand(3, 2, generator=GEN)
    return {  # name: (kernel-layout weights, their call, checkpoint-layout weights, their call)
        "fp8": ((w_p, s_bk), lambda: ops.blockquant_fp8_gemm(x, w_p, s_bk, 32, 32),
                (codes, scale), lambda: ops.blockquant_fp8_gemm(x, codes, scale, 32, 32)),
        "fp8_grouped": ((w_p, s_bk), lambda: ops.blockquant_fp8_grouped_gemm(x3, w_p, s_bk, 32, 32),
                        (codes, scale), lambda: ops.blockquant_fp8_grouped_gemm(x3, codes, scale, 32, 32)),
        "fp4_static": (laid, lambda: ops.fp4_static_experts(x, idx, weights, *laid, 32, 10.0),
                       (w13, s13, w2, s2), lambda: ops.fp4_static_experts(x, idx, weights, w13, s13, w2, s2, 32, 10.0)),
        "fp4_active": (laid, lambda: ops.fp4_active_experts(x, idx, weights, *laid, 32, 10.0),
                       (w13, s13, w2, s2), lambda: ops.fp4_active_experts(x, idx, weights, w13, s13, w2, s2, 32, 10.0)),
    }


@pytest.mark.parametrize("name", ["fp8", "fp8_grouped", "fp4_static", "fp4_active"])
def test_a_wrapper_call_does_no_layout_op_on_stored_weights(monkeypatch, name):
    weights, call, ckpt_weights, ckpt_call = _calls()[name]
    mode = _record(monkeypatch, weights, call)
    assert mode.ops == []
    stored = {w.untyped_storage().data_ptr() for w in weights}
    # every stored tensor reaches the kernel as stored (itself, or a contiguous piece: expert e of a stack)
    given = [a for a in mode.kernel_args if a.untyped_storage().data_ptr() in stored]
    assert {a.untyped_storage().data_ptr() for a in given} == stored
    assert all(a.is_contiguous() for a in given)
    # negative control: the checkpoint layout is laid out per call, and the recorder sees it
    control = _record(monkeypatch, ckpt_weights, ckpt_call)
    assert control.ops, name
    ckpt = {w.untyped_storage().data_ptr() for w in ckpt_weights}
    assert not any(a.untyped_storage().data_ptr() in ckpt for a in control.kernel_args)


# --- the range check, once at load ----------------------------------------------------------------------
def _fp8_model(codes):
    root = nn.Module()
    root.attn = nn.Module()
    root.attn.wq_a = PackedFp8Linear(codes.shape[1], codes.shape[0], WeightFormat("fp8", (32, 32)))
    root.attn.wq_a.weight = codes
    return root


def test_the_fp8_range_check_runs_at_load_and_names_the_tensor(monkeypatch):
    codes, scale = _fp8_weight(64, 128)
    bad = codes.clone()
    bad[3, 5] = 0x7C   # 320 in e4m3fn: no trn2 e4m3 value
    with pytest.raises(ValueError, match=r"attn\.wq_a\.weight: 1 e4m3 codes above 240"):
        lay_out_model(_fp8_model(bad))
    model = _fp8_model(codes)
    assert lay_out_model(model) == 1 and lay_out_model(model) == 0   # idempotent
    lin = model.attn.wq_a
    assert lin.weight.shape == (128, 1, 64) and lin.scale.dtype == torch.bfloat16
    # a call on the stored layout reads no code on the host
    def check(*args):
        raise RuntimeError("a range check in a call")
    monkeypatch.setattr(kl, "check_trn2_codes", check)
    ops.blockquant_fp8_gemm(torch.randn(2, 128, generator=GEN), lin.weight, lin.scale, 32, 32)
    with pytest.raises(RuntimeError, match="range check"):   # control: the checkpoint layout is checked per call
        ops.blockquant_fp8_gemm(torch.randn(2, 128, generator=GEN), codes, scale, 32, 32)


# --- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["tiny_v41_dir", "tiny_v4_dir"])
def test_memory_report_counts_the_neuron_layouts(fixture, request):
    """fp4 experts keep exactly their checkpoint bytes; an fp8 linear's scale values take 2 bytes per
    block_cols weights of a row block (plus any K padding), which the report counts."""
    cfg = ModelConfig.from_pretrained(str(request.getfixturevalue(fixture)))
    plain = mr.memory_report(cfg, torch.bfloat16, post_load=True)
    laid = mr.memory_report(cfg, torch.bfloat16, post_load=True, platform=NeuronPlatform(host=True))
    res, ck = laid["resident_bytes"], laid["checkpoint_bytes"]
    assert res["routed_experts"] == ck["routed_experts"] == plain["resident_bytes"]["routed_experts"]
    model = mr.build_meta_model(cfg, torch.bfloat16, platform=NeuronPlatform(host=True), post_load=True)
    fp8 = [m for m in model.modules() if isinstance(m, PackedFp8Linear)]
    assert fp8 and all(kl.fp8_is_kernel_layout(m.weight) for m in fp8)
    grown = sum(kl.layout_bytes("fp8", m.out_features, m.in_features, m.block) for m in fp8)
    before = sum(m.out_features * m.in_features + -(-m.out_features // m.block[0]) * -(-m.in_features // m.block[1])
                 for m in fp8)
    assert laid["resident_bytes"]["total"] - plain["resident_bytes"]["total"] == grown - before > 0

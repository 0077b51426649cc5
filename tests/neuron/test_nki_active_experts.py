"""The fp4 active-experts NKI kernel (kernels/fp4_active_experts.py) in the interpreter: a runtime
loop over the compacted hit experts whose DMAs read only their weights, equal bit for bit to the
all-experts wrapper, and the interpreter's runtime-value rules (registers, dynamic DMA offsets)."""
import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers import quant
from deepinfer.model_executor.layers.moe import active_expert_slots
from deepinfer.neuron_ops import kernel_routing
from deepinfer.neuron_ops.nki import api, ops
from deepinfer.neuron_ops.nki.interpreter import NkiRuleError
from deepinfer.neuron_ops.nki.kernels.fp4_active_experts import fp4_active_experts_kernel

nki, nl, nisa = api.nki, api.nl, api.nisa
GEN = torch.Generator().manual_seed(5)
pytestmark = pytest.mark.skipif(not api.INTERPRETED, reason="reads the interpreter's DMA accounting")


def _experts(e=6, dim=64, inter=32):
    q13, s13 = quant.quantize_fp4(torch.randn(e, 2 * inter, dim, generator=GEN) * 0.2, 32)
    q2, s2 = quant.quantize_fp4(torch.randn(e, dim, inter, generator=GEN) * 0.2, 32)
    return tuple(a.view(torch.uint8) for a in (q13, s13, q2, s2))


def _routing(t, hit, k=2, e=6):
    pool = torch.tensor(hit)
    idx = pool[torch.randint(len(pool), (t, k), generator=GEN)]
    return idx, torch.rand(t, k, generator=GEN) + 0.05


# M 1..130 (both sides of the 128-row launch limit), one / some / every expert hit, and none
ROWS = [1, 2, 7, 64, 129, 130]
HITS = [[3], [0, 2, 5], list(range(6))]


@pytest.mark.parametrize("rows", [[3, 130], ROWS], ids=["fast", "sweep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_active_kernel_equals_the_all_experts_kernel_bitwise(dtype, rows):
    experts = _experts()
    for t in rows:
        x = torch.randn(t, 64, generator=GEN).to(dtype)
        for hit in HITS + [None]:
            idx, w = _routing(t, hit or [1])
            if hit is None:
                w = torch.zeros_like(w)
            got = ops.fp4_active_experts(x, idx, w, *experts, 32, 10.0)
            want = ops.fp4_static_experts(x, idx, w, *experts, 32, 10.0)
            assert got.dtype == dtype and torch.equal(got, want), (t, hit)
            ref = kernel_routing.reference("fp4_active_experts")(x, idx, w, *experts, 32, 10.0)
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()))


def test_dma_reads_only_the_hit_experts():
    w13, s13, w2, s2 = _experts()
    x = torch.randn(4, 64, generator=GEN)
    idx = torch.tensor([[4, 1], [1, 4], [4, 4], [2, 1]])
    w = torch.tensor([[0.5, 0.5], [0.3, 0.7], [1.0, 0.0], [0.0, 0.4]])   # expert 2's one pair weighs 0
    ids, count = active_expert_slots(idx, w, 6)
    w_t = nki.hbm(w13.transpose(1, 2).contiguous().numpy())
    s_t = nki.hbm(s13.transpose(1, 2).contiguous().numpy())
    args = (nki.hbm(x[:, 0::2].contiguous().numpy()[None]), nki.hbm(x[:, 1::2].contiguous().numpy()[None]), w_t, s_t,
            nki.hbm(ops._fp4_onehot(32).float().numpy(), nl.bfloat16),
            nki.hbm(ids.to(torch.int32).numpy().reshape(-1, 1, 1)), nki.hbm(np.array([[int(count)]], np.int32)), 32)
    out = fp4_active_experts_kernel[nl.nc(2)](*args)
    stats = fp4_active_experts_kernel.last_stats
    read = stats.read_mask(w_t).reshape(6, -1)
    assert read.any(axis=1).tolist() == [False, True, False, False, True, False]
    assert read[[1, 4]].all()                                   # the hit experts' every byte
    assert stats.read_mask(s_t).reshape(6, -1).any(axis=1).tolist() == read.any(axis=1).tolist()
    assert stats.bytes_read(w_t) == 2 * w13[0].numel()
    assert np.array_equal(out.numpy()[2:], np.zeros_like(out.numpy()[2:]))   # unused slots untouched
    # the wrapper's DMA bytes: the activations and two experts, against all six for the all-experts form
    ops.fp4_active_experts(x, idx, w, w13, s13, w2, s2, 32, 10.0)
    active = ops.last_stats().dma_bytes_in
    ops.fp4_static_experts(x, idx, w, w13, s13, w2, s2, 32, 10.0)
    full = ops.last_stats().dma_bytes_in
    per_expert = sum(a[0].numel() for a in (w13, s13, w2, s2))
    assert full - active >= 4 * per_expert


def _probe(fn):
    @nki.jit
    def kernel(src):
        fn(src)
        return nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    return kernel


def _load_register(src):
    reg = nisa.register_alloc()
    nisa.register_load(reg, nl.load(src[0]))
    return reg


@pytest.mark.parametrize("misuse,rule", [
    (lambda src: bool(_load_register(src)), "register-host"),
    (lambda src: range(_load_register(src)), "register-host"),
    (lambda src: list(nl.dynamic_range(0, _load_register(src), step=_load_register(src))), "dynamic-range-step"),
    (lambda src: nisa.register_load(nisa.register_alloc(), nl.load(src[0], dtype=nl.float32)), "register-load"),
    (lambda src: nl.load(src[_load_register(src) + 0]), None),
    (lambda src: nl.load(src[0:1, _load_register(src)]), "dynamic-offset"),
])
def test_runtime_values_follow_the_device_rules(misuse, rule):
    src = nki.hbm(np.array([[[7]]], np.int32))
    if rule is None:
        with pytest.raises(TypeError):      # registers do no Python arithmetic either
            _probe(misuse)(src)
        return
    with pytest.raises(NkiRuleError, match=rule):
        _probe(misuse)(src)


def test_dynamic_offset_dma_out_of_bounds_errors_unless_skipped():
    table = nki.hbm(np.arange(12, dtype=np.float32).reshape(3, 1, 4))
    ids = nki.hbm(np.array([[[2]], [[5]]], np.int32))

    @nki.jit
    def gather(table, ids, mode):
        out = nl.ndarray((2, 1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        for j in nl.static_range(2):
            reg = nisa.register_alloc()
            nisa.register_load(reg, nl.load(ids[j]))
            row = nl.zeros((1, 4), dtype=nl.float32)
            nisa.dma_copy(dst=row, src=table[reg], oob_mode=mode)
            nl.store(out[j], row)
        return out
    out = gather(table, ids, nisa.oob_mode.skip)
    assert out.numpy()[0, 0].tolist() == [8, 9, 10, 11] and not out.numpy()[1].any()
    assert gather.last_stats.read_mask(table).reshape(3, -1).any(axis=1).tolist() == [False, False, True]
    with pytest.raises(NkiRuleError, match="dma-oob"):
        gather(table, ids, nisa.oob_mode.error)

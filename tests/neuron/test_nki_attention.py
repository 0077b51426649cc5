"""The sink-attention, indexer-score and mHC NKI kernels run in the interpreter equal their PyTorch
references over decode shape sweeps, within trn2's rules; and the two interpreter instructions only
they use (nl.where, nisa.scalar_tensor_tensor) agree with NumPy and fail with the rule they break.

Tolerances: fp32 paths are exact up to fp32 summation order (rtol 1e-5). sink_attention rounds
P to bf16 before P.V (bf16 models): each p_k then carries a relative error <= 2^-8, so
|out - ref| <= 2^-8 * sum_k prob_k |v_k| (+ one bf16 ulp of the output for bf16 outputs)."""
import numpy as np
import pytest
import torch

from deepinfer.neuron_ops import kernel_routing
from deepinfer.neuron_ops.nki import api, attention_ops, ops
from deepinfer.neuron_ops.nki.interpreter import NkiRuleError

GEN = torch.Generator().manual_seed(14)
BF16_U = 2.0 ** -8


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(1e-30))[1] - 8)


def _within_ulps(got, want, slack=0.0):
    """One bf16 ulp of want, plus `slack` for fp32 summation order under cancellation."""
    w = want.float()
    return bool(((got.float() - w).abs() <= _ulp_bf16(w) + slack).all())


def _post_slack(x, y, post, comb):
    """8 fp32 ulps of the sum of |terms| of post_k y + sum_j comb[j, k] X[j]."""
    mag = post.unsqueeze(-1) * y.float().abs().unsqueeze(1) + torch.bmm(comb.transpose(1, 2), x.float().abs())
    return 2.0 ** -21 * mag


# --- sink_attention --------------------------------------------------------------------------------
def _attn_inputs(t, h, d, e, dtype, p_valid=0.7):
    q = (torch.randn(t, h, d, generator=GEN) * 2).to(dtype)
    keys = torch.randn(t, e, d, generator=GEN).to(dtype)
    valid = torch.rand(t, e, generator=GEN) < p_valid
    if t > 1:
        valid[t // 2] = False            # a padded token: no valid key at all
        keys[t // 2] = 0
    sink = torch.randn(h, generator=GEN)
    return q, keys, valid, sink


def _p_rounding_bound(q, keys, valid, sink, scale):
    """2^-8 * sum_k prob_k |v_k| from the reference's fp32 probabilities."""
    s = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([s, sink.float().view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return BF16_U * torch.einsum("thk,tkd->thd", probs, keys.float().abs())


def _check_attention(t, h, d, e, dtype):
    q, keys, valid, sink = _attn_inputs(t, h, d, e, dtype)
    scale = d ** -0.5
    want = kernel_routing.reference("sink_attention")(q, keys, valid, sink, scale)
    got = attention_ops.sink_attention(q, keys, valid, sink, scale)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if t > 1:
        assert torch.equal(got[t // 2], torch.zeros(h, d, dtype=dtype))
    bound = _p_rounding_bound(q, keys, valid, sink, scale)
    err = (got.float() - want.float()).abs()
    if dtype == torch.float32:  # exact mode: P stays fp32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert bool((err <= bound + _ulp_bf16(want.float()) + 1e-6).all()), float((err - bound).max())


@pytest.mark.parametrize("t,h,d,e", [(1, 4, 64, 1), (3, 8, 192, 100), (5, 16, 128, 640), (2, 130, 64, 70),
                                     (4, 4, 576, 65)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_equals_reference(t, h, d, e, dtype):
    _check_attention(t, h, d, e, dtype)


def test_sink_attention_rounds_p_to_bf16_per_the_rule():
    """fp32 inputs with the bf16 rule forced: an error appears, and stays within 2^-8 sum prob |v|."""
    q, keys, valid, sink = _attn_inputs(2, 8, 128, 300, torch.float32)
    want = kernel_routing.reference("sink_attention")(q, keys, valid, sink, 0.1)
    got = attention_ops.sink_attention(q, keys, valid, sink, 0.1, p_bf16=True)
    err = (got - want).abs()
    assert err.max() > 1e-5
    assert bool((err <= _p_rounding_bound(q, keys, valid, sink, 0.1) + 1e-6).all())


def test_sink_attention_sink_takes_the_mass():
    q, keys, valid, _ = _attn_inputs(2, 4, 64, 40, torch.float32, p_valid=1.0)
    loud = torch.full((4,), 60.0)
    got = attention_ops.sink_attention(q, keys, valid, loud, 0.125)
    torch.testing.assert_close(got, kernel_routing.reference("sink_attention")(q, keys, valid, loud, 0.125),
                               rtol=1e-5, atol=1e-8)
    assert got.abs().max() < 1e-10


def test_sink_attention_counts_and_rules_at_a_flash_like_shape():
    """V4.1-Flash heads and head_dim (64 x 512), SWA 128 + top-512 keys, 2 tokens: the matmul
    count is the tiling's, and the launch stayed within the PSUM banks."""
    t, h, d, e = 2, 64, 512, 640
    q, keys, valid, sink = _attn_inputs(t, h, d, e, torch.bfloat16)
    attention_ops.sink_attention(q, keys, valid, sink, d ** -0.5)
    st = ops.last_stats()
    blocks = e // 64
    # per token: q transposes 4, key transposes 4 per 64-key block, score matmuls 4 + 1 per chunk (2
    # chunks), P transposes 1 and P.V 1 per block
    assert st.instructions["tensor"] == t * (4 + 4 * blocks + 2 * 5 + 2 * blocks)
    assert st.dma_bytes_in >= t * e * d * 2 and st.peak_psum_banks <= 8


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 8, 64])
def test_sink_attention_flash_decode_sweep(t):
    _check_attention(t, 64, 512, 640, torch.bfloat16)


# --- index_scores ----------------------------------------------------------------------------------
def _check_index(t, heads, d, e, q_dtype, key_scale):
    q = torch.randn(t, heads, d, generator=GEN).to(q_dtype)
    keys = torch.randn(t, e, d, generator=GEN)
    w = torch.randn(t, heads, generator=GEN)
    valid = torch.rand(t, e, generator=GEN) < 0.8
    if t > 1:
        valid[-1] = False
    want = kernel_routing.reference("index_scores")(q, keys, w, valid, key_scale)
    got = attention_ops.index_scores(q, keys, w, valid, key_scale)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    assert torch.equal(got == float("-inf"), ~valid) and torch.equal(want == float("-inf"), ~valid)
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("t,heads,d,e", [(1, 32, 128, 1), (3, 32, 128, 700), (6, 8, 64, 130), (2, 130, 192, 40)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_index_scores_equals_reference(t, heads, d, e, q_dtype):
    _check_index(t, heads, d, e, q_dtype, 128 ** -0.5)


def test_index_scores_relu_and_negative_key_scale():
    """Negative products drop out before the head sum (ReLU), whatever the weights' and key_scale's signs."""
    q = torch.ones(1, 2, 8)
    keys = torch.stack([torch.ones(8), -torch.ones(8)])[None]
    w = torch.tensor([[2.0, -1.0]])
    valid = torch.tensor([[True, True]])
    got = attention_ops.index_scores(q, keys, w, valid, -0.5)
    assert got.tolist() == [[(2.0 - 1.0) * 8 * -0.5, 0.0]]


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 64])
def test_index_scores_flash_decode_sweep(t):
    _check_index(t, 32, 128, 2000, torch.bfloat16, 1.0)


# --- mHC -------------------------------------------------------------------------------------------
def _hc_inputs(t, n, dim, dtype):
    x = torch.randn(t, n, dim, generator=GEN).to(dtype)
    if t > 1:
        x[t // 2] = 0                    # a padded token
    fn = torch.randn(2 * n + n * n, n * dim, generator=GEN) * (n * dim) ** -0.5
    base = torch.randn(2 * n + n * n, generator=GEN) * 0.5
    scale = torch.rand(3, generator=GEN) + 0.5
    return x, fn, base, scale


@pytest.mark.parametrize("t,n,dim", [(1, 4, 64), (5, 4, 200), (64, 4, 96), (130, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mixes_equals_reference(t, n, dim, dtype):
    x, fn, base, scale = _hc_inputs(t, n, dim, dtype)
    want = kernel_routing.reference("hc_mixes")(x, fn, base, scale, 1e-6, 1e-6, 20)
    got = attention_ops.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    comb = got[2]
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(t, n), rtol=1e-4, atol=1e-4)  # doubly stochastic


@pytest.mark.parametrize("iters", [1, 3])
def test_hc_mixes_iteration_count(iters):
    x, fn, base, scale = _hc_inputs(3, 4, 32, torch.float32)
    want = kernel_routing.reference("hc_mixes")(x, fn, base, scale, 1e-6, 1e-3, iters)
    got = attention_ops.hc_mixes(x, fn, base, scale, 1e-6, 1e-3, iters)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,n,dim", [(1, 4, 64), (7, 4, 2100), (130, 4, 32), (3, 1, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_and_post_equal_reference(t, n, dim, dtype):
    x = torch.randn(t, n, dim, generator=GEN).to(dtype)
    y = torch.randn(t, dim, generator=GEN).to(dtype)
    pre = torch.rand(t, n, generator=GEN)
    post = torch.rand(t, n, generator=GEN) * 2
    comb = torch.softmax(torch.randn(t, n, n, generator=GEN), dim=-1)
    pre_slack = 2.0 ** -21 * (pre.unsqueeze(-1) * x.float().abs()).sum(dim=1)
    for got, want, slack in ((attention_ops.hc_pre(x, pre), kernel_routing.reference("hc_pre")(x, pre), pre_slack),
                             (attention_ops.hc_post(x, y, post, comb), kernel_routing.reference("hc_post")(x, y, post, comb),
                              _post_slack(x, y, post, comb))):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert _within_ulps(got, want, slack)


@pytest.mark.slow
def test_hc_flash_shapes():
    """V4.1-Flash: hidden 5120, hc_mult 4, 20 Sinkhorn iterations, 64 decode tokens."""
    x, fn, base, scale = _hc_inputs(64, 4, 5120, torch.bfloat16)
    want = kernel_routing.reference("hc_mixes")(x, fn, base, scale, 1e-6, 1e-6, 20)
    got = attention_ops.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    y = torch.randn(64, 5120, generator=GEN).bfloat16()
    assert _within_ulps(attention_ops.hc_pre(x, want[0]), kernel_routing.reference("hc_pre")(x, want[0]))
    assert _within_ulps(attention_ops.hc_post(x, y, want[1], want[2]),
                        kernel_routing.reference("hc_post")(x, y, want[1], want[2]), _post_slack(x, y, want[1], want[2]))


def test_registry_names_are_references():
    assert set(attention_ops.WRAPPERS) <= set(kernel_routing.NKI_KERNELS)


# --- the interpreter instructions these kernels added ----------------------------------------------
needs_interpreter = pytest.mark.skipif(not api.INTERPRETED, reason="interpreter-only checks")


def _launch(fn, *args):
    return api.nki.jit(fn)(*args)


@needs_interpreter
def test_where_and_scalar_tensor_tensor_agree_with_numpy():
    nl, nisa = api.nl, api.nisa
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((8, 5)).astype(np.float32)
    cond = (rng.random((8, 5)) < 0.5).astype(np.uint8)
    col = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(a_h, b_h, c_h, col_h):
        out = nl.ndarray((3, 8, 5), dtype=nl.float32, buffer=nl.shared_hbm)
        ta, tb, tc, tcol = nl.load(a_h), nl.load(b_h), nl.load(c_h), nl.load(col_h)
        nl.store(out[0], nl.where(tc, ta, tb))
        nl.store(out[1], nl.where(tc, ta, float("-inf")))
        nl.store(out[2], nisa.scalar_tensor_tensor(data=ta, op0=nl.multiply, operand0=tcol, op1=nl.add, data1=tb))
        return out

    out = _launch(kernel, a, b, cond, col).numpy()
    np.testing.assert_array_equal(out[0], np.where(cond != 0, a, b))
    np.testing.assert_array_equal(out[1], np.where(cond != 0, a, -np.inf))
    np.testing.assert_array_equal(out[2], (a * col + b).astype(np.float32))
    assert api.nki.last_stats().instructions["vector"] == 3   # the raw launch, not a wrapper call


@needs_interpreter
@pytest.mark.parametrize("case,rule", [("where-shape", "shape"), ("where-hbm", "compute-on-chip"),
                                       ("stt-operand", "shape"), ("stt-bitvec", "shape"),
                                       ("stt-hbm", "compute-on-chip")])
def test_select_and_multiply_add_instructions_enforce_rules(case, rule):
    nl, nisa = api.nl, api.nisa
    a = np.ones((4, 6), np.float32)

    def kernel(a_h):
        t = nl.load(a_h)
        if case == "where-shape":
            nl.where(t[:, 0:3], t, 0.0)
        elif case == "where-hbm":
            nl.where(t, a_h, 0.0)
        elif case == "stt-operand":
            nisa.scalar_tensor_tensor(data=t, op0=nl.multiply, operand0=t[:, 0:2], op1=nl.add, data1=t)
        elif case == "stt-bitvec":
            nisa.scalar_tensor_tensor(data=t, op0=nl.left_shift, operand0=1, op1=nl.add, data1=t)
        else:
            nisa.scalar_tensor_tensor(data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, data1=a_h)
        return t

    with pytest.raises(NkiRuleError) as err:
        _launch(kernel, a)
    assert err.value.rule == rule and str(err.value).startswith(f"[trn2 rule {rule}]")

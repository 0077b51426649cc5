"""The NKI interpreter: every trn2 rule fails with its message, the instructions agree with NumPy,
dtypes round as the hardware formats do, and launches give each program instance its id."""
import numpy as np
import pytest
import torch

from deepinfer.neuron_ops.nki import interpreter as nki
from deepinfer.neuron_ops.nki.interpreter import dtypes
from deepinfer.neuron_ops.nki.interpreter import isa as nisa
from deepinfer.neuron_ops.nki.interpreter import language as nl
from deepinfer.neuron_ops.nki.interpreter.rules import RULES, NkiRuleError

RNG = np.random.default_rng(0)


def run(body, *args, grid=1):
    """Run `body(*args)` as a one-off kernel and return its result."""
    return nki.jit(body)[grid](*args)


def rule_fails(rule, body, *args):
    with pytest.raises(NkiRuleError, match=rf"\[trn2 rule {rule}\]") as e:
        run(body, *args)
    assert e.value.rule == rule and RULES[rule] in str(e.value)


# --- each rule -----------------------------------------------------------------------------------
def test_partition_dim():
    rule_fails("partition-dim", lambda: nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf))
    run(lambda: nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf))  # the limit itself is fine


def _mm(k, m, n, dtype=nl.bfloat16, stationary_buffer=nl.sbuf):
    def body():
        s = nl.zeros((k, m), dtype, buffer=stationary_buffer)
        v = nl.zeros((k if k <= 128 else 128, n), dtype, buffer=nl.sbuf)
        return nisa.nc_matmul(s, v)
    return body


def test_matmul_shape_rules():
    run(_mm(128, 128, 512))
    rule_fails("partition-dim", _mm(256, 8, 8))   # a 256-partition operand cannot exist
    with pytest.raises(NkiRuleError, match="matmul-contraction"):
        def body():
            return nisa.nc_matmul(nl.zeros((64, 8), nl.bfloat16), nl.zeros((32, 8), nl.bfloat16))
        run(body)
    rule_fails("matmul-stationary-free", _mm(128, 129, 8))
    rule_fails("matmul-moving-free", _mm(128, 8, 513))


def test_matmul_inputs_and_dtypes():
    rule_fails("matmul-inputs-sbuf", _mm(128, 8, 8, stationary_buffer=nl.psum))
    rule_fails("no-fp4-matmul", _mm(128, 8, 8, dtype=nl.uint8))
    rule_fails("no-fp4-matmul", _mm(128, 8, 8, dtype=nl.int32))
    run(_mm(128, 8, 8, dtype=nl.float8_e4m3))


def test_matmul_output_fp32_psum():
    def into(dtype, buffer):
        def body():
            acc = nl.zeros((8, 16), dtype, buffer=buffer)
            acc += nisa.nc_matmul(nl.zeros((32, 8), nl.bfloat16), nl.zeros((32, 16), nl.bfloat16))
        return body
    run(into(nl.float32, nl.psum))
    rule_fails("matmul-output-fp32-psum", into(nl.bfloat16, nl.psum))
    rule_fails("matmul-output-fp32-psum", into(nl.float32, nl.sbuf))

    def assign_to_sbuf():
        t = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        t[...] = nisa.nc_matmul(nl.zeros((32, 8), nl.bfloat16), nl.zeros((32, 16), nl.bfloat16))
    rule_fails("matmul-output-fp32-psum", assign_to_sbuf)


def test_psum_banks():
    def banks(n):
        def body():
            live = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(n)]
            return len(live)
        return body
    assert run(banks(8)) == 8
    rule_fails("psum-banks", banks(9))
    # a 2-bank tile counts twice
    rule_fails("psum-banks", lambda: [nl.ndarray((128, 1024), nl.float32, buffer=nl.psum) for _ in range(5)])


def test_psum_banks_are_released_when_a_tile_dies():
    def body():
        for _ in range(20):
            t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            del t
    run(body)


def test_sbuf_budget():
    run(lambda: nl.ndarray((128, 192 * 1024 // 4), nl.float32, buffer=nl.sbuf))
    rule_fails("sbuf-budget", lambda: [nl.ndarray((128, 96 * 1024), nl.uint8, buffer=nl.sbuf) for _ in range(3)])


def test_dma_only_between_hbm_and_sbuf():
    x = np.ones((4, 8), np.float32)
    rule_fails("dma-hbm-sbuf", lambda: nl.load(nl.zeros((4, 8), nl.float32)))
    rule_fails("dma-hbm-sbuf", lambda a: nl.store(nl.zeros((4, 8), nl.float32), nl.load(a)), x)

    def store_from_psum(a):
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.zeros((4, 8), nl.float32, buffer=nl.psum))
    rule_fails("dma-hbm-sbuf", store_from_psum, x)

    def load_into_psum(a):
        p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        p[...] = nl.load(a)
    rule_fails("dma-hbm-sbuf", load_into_psum, x)


def test_no_compute_on_hbm():
    x = np.ones((4, 8), np.float32)
    rule_fails("compute-on-chip", lambda a: nisa.tensor_scalar(a, nl.multiply, 2.0), x)
    rule_fails("compute-on-chip", lambda a: nisa.activation(op=nl.exp, data=a), x)
    rule_fails("compute-on-chip", lambda a: nl.multiply(a, 2.0), x)
    rule_fails("compute-on-chip", lambda a: nisa.tensor_reduce(nl.add, a, axis=1), x)


def test_lnc_two_program_ids():
    with pytest.raises(NkiRuleError, match=r"\[trn2 rule lnc\]"):
        nl.nc(4)
    ids = []
    run(lambda: ids.append((nl.program_id(0), nl.num_programs(0))), grid=nl.nc(2))
    assert ids == [(0, 2), (1, 2)]


def test_bitvec_needs_integers_and_transpose_sizes():
    rule_fails("bitvec-int", lambda: nisa.tensor_scalar(nl.zeros((4, 4), nl.float32), nl.left_shift, 1))
    rule_fails("transpose-size", lambda: nisa.nc_transpose(nl.zeros((64, 64), nl.float32), engine=nisa.vector_engine))
    run(lambda: nisa.nc_transpose(nl.zeros((128, 128), nl.float32)))


def test_program_id_needs_a_launch():
    with pytest.raises(RuntimeError, match="kernel launched"):
        nl.program_id(0)


# --- numerics ------------------------------------------------------------------------------------
def _tile(a, dtype=nl.float32):
    """Load NumPy values `a` into an SBUF tile inside a kernel."""
    return nl.load(nki.hbm(a, dtype))


def test_matmul_agrees_with_numpy():
    s = RNG.standard_normal((96, 40)).astype(np.float32)
    m = RNG.standard_normal((96, 300)).astype(np.float32)
    out = run(lambda: nisa.nc_matmul(_tile(s), _tile(m)))
    assert out.buffer == "psum" and out.dtype is nl.float32 and out.shape == (40, 300)
    np.testing.assert_allclose(out.numpy(), s.T @ m, rtol=1e-5, atol=1e-4)
    # bf16 inputs: the product of the rounded values, accumulated in fp32
    out = run(lambda: nisa.nc_matmul(_tile(s, nl.bfloat16), _tile(m, nl.bfloat16)))
    sb, mb = (torch.from_numpy(v).bfloat16().float().numpy() for v in (s, m))
    np.testing.assert_allclose(out.numpy(), sb.T @ mb, rtol=1e-5, atol=1e-4)


def test_psum_accumulation_over_k_tiles():
    x = RNG.standard_normal((256, 8)).astype(np.float32)
    w = RNG.standard_normal((256, 64)).astype(np.float32)

    def body():
        acc = nl.zeros((8, 64), nl.float32, buffer=nl.psum)
        for k in range(2):
            acc += nisa.nc_matmul(_tile(x[k * 128:(k + 1) * 128]), _tile(w[k * 128:(k + 1) * 128]))
        return nl.copy(acc)
    np.testing.assert_allclose(run(body).numpy(), x.T @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape,engine", [((100, 70), nisa.tensor_engine), ((20, 30), nisa.vector_engine)])
def test_transpose(shape, engine):
    a = RNG.standard_normal(shape).astype(np.float32)
    out = run(lambda: nisa.nc_transpose(_tile(a), engine=engine))
    np.testing.assert_array_equal(out.numpy(), a.T)
    assert out.buffer == ("psum" if engine == nisa.tensor_engine else "sbuf")


def test_activation_scale_bias_and_reduce():
    a = RNG.standard_normal((16, 50)).astype(np.float32)
    bias = RNG.standard_normal((16, 1)).astype(np.float32)

    def body():
        acc = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        y = nisa.activation(op=nl.exp, data=_tile(a), bias=_tile(bias), scale=0.5, reduce_op=nl.add, reduce_res=acc)
        return y, acc
    y, acc = run(body)
    want = np.exp(a * 0.5 + bias)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(acc.numpy(), want.sum(1, keepdims=True), rtol=1e-5)
    silu = run(lambda: nisa.activation(op=nl.silu, data=_tile(a))).numpy()
    np.testing.assert_allclose(silu, torch.nn.functional.silu(torch.from_numpy(a)).numpy(), rtol=1e-6, atol=1e-7)


def test_reductions():
    a = RNG.standard_normal((8, 6, 10)).astype(np.float32)
    np.testing.assert_allclose(run(lambda: nisa.tensor_reduce(nl.add, _tile(a), axis=(1, 2))).numpy(),
                               a.sum((1, 2)), rtol=1e-5)
    np.testing.assert_array_equal(run(lambda: nisa.tensor_reduce(nl.max, _tile(a), axis=2, keepdims=True)).numpy(),
                                  a.max(2, keepdims=True))
    np.testing.assert_array_equal(run(lambda: nisa.tensor_reduce(nl.add, _tile(a), axis=2, negate=True)).numpy(),
                                  -a.sum(2))
    with pytest.raises(NkiRuleError, match="shape"):
        run(lambda: nisa.tensor_reduce(nl.add, _tile(a), axis=1))  # not the last free axis
    np.testing.assert_allclose(run(lambda: nl.mean(_tile(a), axis=2)).numpy(), a.mean(2), rtol=1e-6)


def test_tensor_scalar_and_tensor_tensor():
    a = RNG.standard_normal((8, 12)).astype(np.float32)
    b = RNG.standard_normal((8, 12)).astype(np.float32)
    v = RNG.standard_normal((8, 1)).astype(np.float32)
    got = run(lambda: nisa.tensor_scalar(_tile(a), nl.subtract, _tile(v), reverse0=True, op1=nl.multiply,
                                         operand1=3.0)).numpy()
    np.testing.assert_allclose(got, (v - a) * 3.0, rtol=1e-6)
    got = run(lambda: nisa.tensor_tensor(_tile(a), _tile(b), nl.maximum, dtype=nl.bfloat16))
    assert got.dtype is nl.bfloat16
    np.testing.assert_array_equal(got.numpy(), torch.from_numpy(np.maximum(a, b)).bfloat16().float().numpy())
    bits = run(lambda: nisa.tensor_scalar(_tile(np.array([[1, 127, 130]], np.uint8), nl.uint8), nl.left_shift, 23,
                                          dtype=nl.int32).view(nl.float32)).numpy()
    np.testing.assert_array_equal(bits, [[2.0 ** -126, 1.0, 8.0]])


# --- dtypes --------------------------------------------------------------------------------------
def test_bf16_rounding_matches_torch():
    a = (RNG.standard_normal(10000) * 10.0 ** RNG.integers(-5, 5, 10000)).astype(np.float32)
    np.testing.assert_array_equal(dtypes.round_to(a, nl.bfloat16), torch.from_numpy(a).bfloat16().float().numpy())


def test_fp8_e4m3_is_trn2_ieee_style():
    codes = np.arange(256, dtype=np.uint8)
    e4m3 = dtypes.from_bits(codes, nl.float8_e4m3)
    fn = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    finite_in_both = (codes & 0x78) != 0x78
    np.testing.assert_array_equal(e4m3[finite_in_both], fn[finite_in_both])
    assert np.nanmax(e4m3[np.isfinite(e4m3)]) == 240.0 and np.isinf(e4m3[0x78])
    assert np.array_equal(dtypes.from_bits(codes, nl.float8_e4m3fn)[finite_in_both], fn[finite_in_both])
    # encode: rounding to nearest (ties to even), overflow beyond 240 to inf, bits round-trip
    assert list(dtypes.round_to(np.array([0.3, 239.0, 250.0, -1e6], np.float32), nl.float8_e4m3)) == \
        [0.3125, 240.0, np.inf, -np.inf]
    finite = codes[np.isfinite(e4m3)]
    np.testing.assert_array_equal(dtypes.to_bits(dtypes.from_bits(finite, nl.float8_e4m3), nl.float8_e4m3), finite)


# --- launches and counts -------------------------------------------------------------------------
def test_grid_shares_outputs_and_counts_engines():
    x = RNG.standard_normal((4, 256)).astype(np.float32)

    @nki.jit
    def double_halves(a):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        half = a.shape[1] // nl.num_programs(0)
        c0 = nl.program_id(0) * half
        t = nl.load(a[:, c0:c0 + half])
        nl.store(out[:, c0:c0 + half], nisa.activation(op=nl.copy, data=t, scale=2.0))
        return out

    out = double_halves[nl.nc(2)](x)
    np.testing.assert_array_equal(out.numpy(), 2 * x)
    stats = double_halves.last_stats.as_dict()
    assert stats is nki.last_stats().as_dict() or stats == nki.last_stats().as_dict()
    assert stats["instructions"] == {"tensor": 0, "vector": 0, "scalar": 2, "gpsimd": 0, "dma": 4}
    assert stats["dma_bytes_in"] == x.nbytes and stats["dma_bytes_out"] == x.nbytes

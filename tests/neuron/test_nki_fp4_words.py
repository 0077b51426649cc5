"""The fp4 word decode (kernels/fp4_word_decode.py, design "words", the default): e4m3 codes built by
integer ops on 32-bit words give the same weights as the seed's one-engine decode (design "vector"),
bit for bit, over every nibble, row counts 1..130 and both activation dtypes; its cost model time
falls below the three-engine float decode's; the interpreter's cross-size view it reads through."""
import numpy as np
import pytest
import torch

from deepinfer.neuron_ops import kernel_routing
from deepinfer.neuron_ops.nki import ops
from deepinfer.neuron_ops.nki.api import nki, nl
from deepinfer.neuron_ops.nki.interpreter import dtypes
from deepinfer.neuron_ops.nki.interpreter.tensor import Tensor

GEN = torch.Generator().manual_seed(22)


def _weight(n, k):
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=GEN),
            torch.randint(118, 130, (n, k // 32), dtype=torch.uint8, generator=GEN))


def test_view_across_item_sizes_is_little_endian():
    t = Tensor(np.array([[1, 2, 3, 4, 5, 6, 7, 8]], np.uint8), dtypes.uint8, "sbuf", None)
    w = t.view(dtypes.uint32)
    assert w.shape == (1, 2) and w.data.tolist() == [[0x04030201, 0x08070605]]
    assert w.view(dtypes.uint8).data.tolist() == t.data.tolist()
    with pytest.raises(ValueError, match="whole"):
        Tensor(np.zeros((1, 6), np.uint8), dtypes.uint8, "sbuf", None).view(dtypes.uint32)


def test_every_nibble_becomes_its_e4m3_code():
    # all 256 bytes: both nibble positions of all 16 codes; value * 2^-6 exactly
    from deepinfer.neuron_ops.nki.kernels.fp4_word_decode import _e4m3_halves
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6] * 2, np.float32) * np.repeat([1, -1], 8)
    byte = np.arange(256, dtype=np.uint8).reshape(2, 128)

    @nki.jit
    def decode(packed):
        lo, hi = _e4m3_halves(nl.load(packed))
        out = nl.ndarray((2, 2, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out[0], nl.copy(lo, dtype=nl.float32))
        nl.store(out[1], nl.copy(hi, dtype=nl.float32))
        return out
    got = decode(nki.hbm(byte)).numpy()
    assert np.array_equal(got[0], e2m1[byte & 15] / 64) and np.array_equal(got[1], e2m1[byte >> 4] / 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_words_equal_the_seed_decode_over_rows(dtype):
    packed, scale = _weight(104, 256)
    for m in (1, 2, 5, 8, 9, 31, 64, 127, 128, 129, 130):
        x = torch.randn(m, 256, generator=GEN).to(dtype)
        got = ops.blockquant_fp4_gemm(x, packed, scale, 32)
        assert torch.equal(got, ops.blockquant_fp4_gemm(x, packed, scale, 32, design="vector")), m
    want = kernel_routing.reference("blockquant_fp4_gemm")(x, packed, scale, 32)
    assert got.dtype == want.dtype and got.shape == want.shape


@pytest.mark.parametrize("n", [1, 6, 350, 513])
def test_words_pad_a_last_tile_of_part_words(n):
    packed, scale = _weight(n, 64)
    x = torch.randn(3, 64, generator=GEN)
    assert torch.equal(ops.blockquant_fp4_gemm(x, packed, scale, 32),
                       ops.blockquant_fp4_gemm(x, packed, scale, 32, design="vector"))


def test_words_cost_less_than_the_float_decodes():
    packed, scale = _weight(1024, 1024)
    x = torch.randn(64, 1024, generator=GEN).bfloat16()
    times = {}
    for design in ("words", "spread", "vector"):
        ops.blockquant_fp4_gemm(x, packed, scale, 32, design=design)
        times[design] = ops.last_stats().predicted_s
    assert times["words"] < times["spread"] / 2 < times["vector"] / 2


def test_rows_up_to_512_share_one_decode_of_each_weight_tile():
    packed, scale = _weight(1024, 1024)
    x = torch.randn(300, 1024, generator=GEN).bfloat16()
    got = ops.blockquant_fp4_gemm(x, packed, scale, 32)
    assert ops.last_stats().launches == 1
    many = ops.last_stats().engine_s
    ops.blockquant_fp4_gemm(x[:100], packed, scale, 32)
    few = ops.last_stats().engine_s
    # 3x the rows: the Vector Engine's decode work is the same (once per weight tile), the matmuls grow
    assert many["vector"] == pytest.approx(few["vector"]) and many["tensor"] > 2 * few["tensor"]
    assert torch.equal(got, ops.blockquant_fp4_gemm(x, packed, scale, 32, design="vector"))

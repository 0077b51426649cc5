"""Fixed-shape active experts (layers/moe.py `active_local_experts`, layers/quant_gemm.py
`fp4_active_experts`): only the experts hit by a pair are read, the results equal the all-experts
forms, and the traced form holds a runtime count (torch.cond), not a host sync."""
import pytest
import torch
from deepinfer.model_executor.layers import moe, quant, quant_gemm
from tests.support.weight_reads import WeightReads

g = torch.Generator().manual_seed(11)


def _routing(t, e, k, hit=None):
    """idx/weights [t, k]; hit: the experts allowed to receive pairs (default all)."""
    pool = torch.arange(e) if hit is None else torch.tensor(hit)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)]) if len(pool) >= k \
        else pool[torch.randint(len(pool), (t, k), generator=g)]
    return idx, torch.rand(t, k, generator=g) + 0.05


def _dense(dtype, e=6, d=32, inter=16):
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * 0.3).to(dtype)
    return w13, w2


def _packed(e=6, d=64, inter=32):
    q13, s13 = quant.quantize_fp4(torch.randn(e, 2 * inter, d, generator=g) * 0.2, 32)
    q2, s2 = quant.quantize_fp4(torch.randn(e, d, inter, generator=g) * 0.2, 32)
    return tuple(a.view(torch.uint8) for a in (q13, s13, q2, s2))


def test_slots_list_the_hit_experts_ascending_with_a_static_length():
    idx = torch.tensor([[4, 1], [1, 0], [5, 2]])
    w = torch.tensor([[0.5, 0.5], [0.2, 0.0], [0.0, 0.0]])   # (1, 0) and row 2 weigh nothing
    ids, count = moe.active_expert_slots(idx, w, 6)
    assert ids.shape == (6,) and int(count) == 2 and ids[:2].tolist() == [1, 4] and (ids[2:] == 6).all()
    ids, count = moe.active_expert_slots(idx[:1], w[:1], 6)
    assert ids.shape == (2,) and ids.tolist() == [1, 4]          # S = min(E, T * k)
    ids, count = moe.active_expert_slots(idx, torch.zeros_like(w), 6)
    assert int(count) == 0 and (ids == 6).all()


def test_threshold_is_the_expected_pairs_per_expert():
    assert moe.use_active_experts(8, 6, 384) and moe.use_active_experts(63, 6, 384)
    assert not moe.use_active_experts(64, 6, 384)                # 384 pairs over 384 experts
    assert moe.use_active_experts(3, 2, 8) and not moe.use_active_experts(4, 2, 8)


ROWS = [1, 2, 3, 5, 8, 17, 64, 127, 128, 130]


# The dense all-experts form runs one batched GEMM over the experts and reduces over them with
# torch's sum (another association order than the slot loop's sequential adds): equal to fp32
# rounding of the sum, in bf16 to one bf16 rounding of the output. The packed form below, whose
# all-experts loop adds in the same order, is equal bit for bit.
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hit", ["some", "none", "all"])
def test_active_equals_the_all_experts_form(dtype, hit):
    w13, w2 = _dense(dtype)
    for t in ROWS:
        x = torch.randn(t, 32, generator=g).to(dtype)
        idx, w = _routing(t, 6, 2, hit=[1, 4] if hit == "some" else None)
        if hit == "none":
            w = torch.zeros_like(w)
        if hit == "all":
            idx[:3] = torch.tensor([[0, 1], [2, 3], [4, 5]])[: min(t, 3)] if t >= 3 else idx[:3]
        got, want = moe.active_local_experts(x, idx, w, w13, w2, 4.0), moe.dense_local_experts(x, idx, w, w13, w2, 4.0)
        err = (got.float() - want.float()).abs().max().item()
        assert got.dtype == dtype and err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), (t, hit, err)
        if hit == "none":
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_active_equals_fp4_static_bitwise(dtype):
    packed = _packed()
    for t in ROWS:
        x = torch.randn(t, 64, generator=g).to(dtype)
        for hit in ([2], [0, 3, 5], None):
            idx, w = _routing(t, 6, 2, hit=hit)
            got = quant_gemm.fp4_active_experts(x, idx, w, *packed, 32, 7.0)
            want = quant_gemm.fp4_static_experts(x, idx, w, *packed, 32, 7.0)
            assert torch.equal(got, want), (t, hit)
        zero = quant_gemm.fp4_active_experts(x, idx, torch.zeros_like(w), *packed, 32, 7.0)
        assert torch.equal(zero, torch.zeros_like(zero))


@pytest.mark.parametrize("form", ["dense", "fp4"])
def test_unhit_experts_are_never_read(form):
    x = torch.randn(3, 64 if form == "fp4" else 32, generator=g)
    idx = torch.tensor([[5, 1], [1, 5], [2, 5]])
    w = torch.tensor([[0.3, 0.7], [0.5, 0.5], [0.0, 0.9]])       # expert 2's only pair weighs 0
    stacks = _packed() if form == "fp4" else _dense(torch.float32)
    with WeightReads(stacks) as reads:
        if form == "fp4":
            quant_gemm.fp4_active_experts(x, idx, w, *stacks, 32, 7.0)
        else:
            moe.active_local_experts(x, idx, w, *stacks, 4.0)
    assert reads.rows == {1, 5} and not reads.whole
    with WeightReads(stacks) as reads:                          # negative control: the all-experts form
        if form == "fp4":
            quant_gemm.fp4_static_experts(x, idx, w, *stacks, 32, 7.0)
        else:
            moe.dense_local_experts(x, idx, w, *stacks, 4.0)
    assert reads.whole or reads.rows == set(range(6))


def test_traced_form_guards_each_slot_with_cond_and_equals_eager():
    w13, w2 = _dense(torch.float32)
    x = torch.randn(2, 32, generator=g)
    idx, w = torch.tensor([[3, 0], [3, 5]]), torch.tensor([[0.5, 0.0], [0.25, 0.75]])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(moe.active_local_experts, backend=backend, fullgraph=True)
    got = compiled(x, idx, w, w13, w2, 4.0)
    assert torch.equal(got, moe.dense_local_experts(x, idx, w, w13, w2, 4.0))
    assert sum(str(n.target).endswith("cond") for n in graphs[0].graph.nodes) == 4    # S = min(6, 2 * 2)
    again = compiled(x, idx, torch.zeros_like(w), w13, w2, 4.0)                        # same graph, count 0
    assert torch.equal(again, torch.zeros_like(again)) and len(graphs) == 1


def test_meta_runs_every_slot():
    packed = [a.to("meta") for a in _packed()]
    x, idx, w = torch.empty(4, 64, device="meta"), torch.zeros(4, 2, dtype=torch.long, device="meta"), \
        torch.empty(4, 2, device="meta")
    assert quant_gemm.fp4_active_experts(x, idx, w, *packed, 32, 7.0).shape == (4, 64)


@pytest.mark.parametrize("held_transposed", [False, True])
def test_an_expert_is_gathered_in_its_stacks_memory_order(held_transposed):
    """The fp32 stacks are held [E, in, out] in memory (v4_ffn.pack): the gathered expert is then a
    plain copy, contiguous as [in, out], the layout the eager loop's GEMM reads; a row-major stack
    gathers [out, in] and is read transposed."""
    w13, _ = _dense(torch.float32)
    if held_transposed:
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    got = moe.expert_weight_t(w13, torch.tensor([4]))
    assert torch.equal(got, w13[4].t())
    assert got.is_contiguous() == held_transposed and got.t().is_contiguous() == (not held_transposed)

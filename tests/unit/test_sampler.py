"""Sampler vs a straightforward per-row implementation of docs/model.md §6, plus invariants."""
import random

import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers import logits_filters
from deepinfer.model_executor.layers.sample_draw import (
    sample_from_logprobs, sample_from_probs, sample_uniforms, splitmix64, verify_uniforms)
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.proposer import DRAFT_SEED_OFFSET

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


# ---- pure-Python reference -------------------------------------------------------------------
def splitmix_py(z: int) -> int:
    z = (z + GAMMA) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform_py(seed: int, pos: int, case: int = 0) -> float:
    s = ((3 * pos + case) * GAMMA) & M64
    return (splitmix_py((seed + (s ^ ((s << 13) & M64))) & M64) >> 11) * 2.0**-53


def reference_row(logits: torch.Tensor, p: SamplingParams, seed: int, pos: int, banned=()):
    """One row, written out as docs/model.md §6 reads: returns (token, processed logprobs)."""
    x = logits.clone().float()
    if banned:
        x[list(banned)] = float("-inf")
    raw = x.clone()
    t = torch.tensor(1e-5 if p.is_greedy else p.temperature, dtype=torch.float32)
    x = x * torch.reciprocal(t)
    if p.top_p < 1.0:
        probs = torch.softmax(x, -1)
        sp, order = torch.sort(probs, descending=True, stable=True)
        drop = (sp.cumsum(-1) - sp) > p.top_p
        x[order[drop]] = float("-inf")
    if p.top_k >= 1:
        order = torch.argsort(x, descending=True, stable=True)
        x[order[p.top_k:]] = float("-inf")
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    lp = torch.log_softmax(x, -1)
    if p.is_greedy:
        return int(raw.argmax()), lp
    cdf = lp.exp().double().cumsum(-1)
    target = uniform_py(seed, pos) * float(cdf[-1])
    return int((cdf > target).nonzero()[0]), lp


def make_logits(n: int, v: int, seed: int = 0, kind: str = "mixed") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 2
    if kind in ("peaky", "mixed"):
        for r in range(n):
            if kind == "peaky" or r % 3 != 2:  # every third row stays flat in "mixed"
                x[r, torch.randperm(v, generator=g)[:20]] += torch.linspace(12, 3, 20)
    if kind == "ties":
        x = torch.randint(-4, 5, (n, v), generator=g).float()  # massive exact ties
    return x


PARAM_GRID = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.3),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    SamplingParams(temperature=0.8, top_p=0.5, top_k=3),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_p=0.8, top_k=100, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.999),
    SamplingParams(temperature=0.5, top_k=5000),
]


# ---- splitmix / uniforms ---------------------------------------------------------------------
def test_splitmix64_known_answers():
    # SplitMix64 from state 0: the published first three outputs.
    got = splitmix64(np.array([0, GAMMA, (2 * GAMMA) & M64], dtype=np.uint64))
    assert [int(v) for v in got] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_uniforms_match_pure_python_u64():
    rng = random.Random(1)
    seeds = [0, 1, 2**63 - 1, 2**64 - 1, 12345] + [rng.getrandbits(64) for _ in range(40)]
    positions = [0, 1, 7, 2**31, 10**12] + [rng.randrange(1 << 40) for _ in range(40)]
    for case in (0, 1):
        got = sample_uniforms(seeds, positions, case)
        assert got.tolist() == [uniform_py(s, p, case) for s, p in zip(seeds, positions)]
    want = [(splitmix_py(s ^ (((3 * p + 2) * GAMMA) & M64)) >> 11) * 2.0**-53 for s, p in zip(seeds, positions)]
    assert verify_uniforms(seeds, positions).tolist() == want
    assert all(0.0 <= u < 1.0 for u in got)


def test_seed_wraps_mod_2_64():
    # A draft stream passes seed + DRAFT_SEED_OFFSET, which may pass 2**64.
    s = 2**64 - 5
    assert sample_uniforms([s + DRAFT_SEED_OFFSET], [3]).tolist() == [uniform_py((s + DRAFT_SEED_OFFSET) & M64, 3)]


# ---- against the reference -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixed", "ties", "flat"])
def test_matches_reference(kind):
    v = 5000  # above the first two top-p probes, so probe, tie and full-sort paths all run
    params = PARAM_GRID * 2
    n = len(params)
    logits = make_logits(n, v, seed=3, kind=kind)
    seeds = [1000 + i for i in range(n)]
    positions = [17 + 5 * i for i in range(n)]
    banned = [[] if i % 4 else [int(logits[i].argmax()), 7] for i in range(n)]
    batch = SamplingBatch.build(params, positions, seeds=seeds, banned_ids_per_row=banned, need_logprobs=True)
    out = Sampler()(logits, batch)
    for i, p in enumerate(params):
        token, lp = reference_row(logits[i], p, seeds[i], positions[i], banned[i])
        assert int(out.token_ids[i]) == token, f"row {i} {p}"
        assert float(out.logprobs[i]) == float(lp[token])
        assert int(out.token_ranks[i]) == int((lp > lp[token]).sum()) + 1
        assert token not in banned[i]


def test_processed_logprobs_equal_reference():
    v = 5000
    params = PARAM_GRID
    logits = make_logits(len(params), v, seed=5, kind="ties")
    batch = SamplingBatch.build(params, [0] * len(params), seeds=[0] * len(params))
    got = Sampler().processed_logprobs(logits, batch)
    for i, p in enumerate(params):
        assert torch.equal(got[i], reference_row(logits[i], p, 0, 0)[1]), f"row {i} {p}"


def test_probe_paths_agree_with_full_sort(monkeypatch):
    # Same rows with the top-p probes disabled (always the full stable sort).
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k)
              for t in (0.6, 1.5) for tp in (0.2, 0.9, 0.99) for k in (-1, 4, 300)]
    logits = make_logits(len(params), 6000, seed=11, kind="mixed")
    logits[::4] = torch.round(logits[::4])  # ties across probe and top-k cuts
    batch = SamplingBatch.build(params, list(range(len(params))), seeds=list(range(len(params))))
    fast = Sampler().processed_logits(logits, batch)
    monkeypatch.setattr(logits_filters, "TOP_P_PROBES", ())
    slow = Sampler().processed_logits(logits, batch)
    assert torch.equal(fast, slow)


# ---- invariants ------------------------------------------------------------------------------
def test_batch_invariance_full_vocab():
    v = 129280
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=42, logprobs=3)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=1),
              SamplingParams(temperature=0.5, top_k=2, logprobs=7), SamplingParams(temperature=1.0, min_p=0.2)]
    logits = make_logits(16, v, seed=9, kind="mixed")
    sampler = Sampler()
    alone = sampler(logits[5:6].clone(), SamplingBatch.build([target], [123]))
    params = [others[i % len(others)] for i in range(16)]
    params[5] = target
    positions = [123 if i == 5 else i for i in range(16)]
    batched = sampler(logits, SamplingBatch.build(params, positions))
    assert int(alone.token_ids[0]) == int(batched.token_ids[5])
    assert float(alone.logprobs[0]) == float(batched.logprobs[5])
    assert torch.equal(alone.top_ids[0], batched.top_ids[5, :3])
    # And without logprobs requested anywhere the token is the same.
    plain = dataclass_replace(target, logprobs=None)
    again = sampler(logits[5:6], SamplingBatch.build([plain], [123]))
    assert int(again.token_ids[0]) == int(alone.token_ids[0])


def dataclass_replace(p, **kw):
    import dataclasses
    return dataclasses.replace(p, **kw)


@pytest.mark.parametrize("p", PARAM_GRID[1:], ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}-m{p.min_p}")
def test_row_alone_equals_row_in_batch(p):
    v = 3000
    logits = make_logits(16, v, seed=21)
    params = [PARAM_GRID[i % len(PARAM_GRID)] for i in range(16)]
    params[7] = p
    seeds = [i * 31 for i in range(16)]
    batched = Sampler()(logits, SamplingBatch.build(params, list(range(16)), seeds=seeds))
    alone = Sampler()(logits[7:8], SamplingBatch.build([p], [7], seeds=[seeds[7]]))
    assert int(batched.token_ids[7]) == int(alone.token_ids[0])


def test_seeded_determinism_and_position_dependence():
    logits = make_logits(1, 2000, seed=2, kind="flat")
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler()
    first = [int(s(logits, SamplingBatch.build([p], [pos])).token_ids[0]) for pos in range(30)]
    second = [int(s(logits, SamplingBatch.build([p], [pos])).token_ids[0]) for pos in range(30)]
    assert first == second
    assert len(set(first)) > 20  # a flat distribution: the position changes the draw
    other_seed = [int(s(logits, SamplingBatch.build([SamplingParams(seed=8)], [pos])).token_ids[0])
                  for pos in range(30)]
    assert other_seed != first


def test_seeds_argument_overrides_params_seed():
    logits = make_logits(1, 2000, seed=2, kind="flat")
    s = Sampler()
    a = s(logits, SamplingBatch.build([SamplingParams(seed=5)], [4])).token_ids
    b = s(logits, SamplingBatch.build([SamplingParams(seed=99)], [4], seeds=[5])).token_ids
    assert torch.equal(a, b)


def test_unseeded_rows_use_rng():
    logits = make_logits(1, 2000, seed=2, kind="flat")
    s = Sampler()
    draw = lambda r: int(s(logits, SamplingBatch.build([SamplingParams()], [0], rng=r)).token_ids[0])  # noqa: E731
    assert draw(random.Random(3)) == draw(random.Random(3))
    assert len({draw(random.Random(i)) for i in range(20)}) > 10


def test_empirical_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().unsqueeze(0)
    s = Sampler()
    p = SamplingParams(temperature=1.0, seed=1)
    n = 4000
    batch = SamplingBatch.build([p] * n, list(range(n)))
    tokens = s(logits.expand(n, 4).contiguous(), batch).token_ids
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    out = Sampler()(logits, SamplingBatch.build([SamplingParams(temperature=0)] * 2, [0, 0]))
    assert out.token_ids.tolist() == [1, 0]
    assert out.logprobs is None


def test_banned_ids_apply_to_greedy_and_sampled_rows():
    logits = torch.zeros(2, 50)
    logits[:, 10] = 100.0
    logits[:, 11] = 90.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    out = Sampler()(logits, SamplingBatch.build(params, [0, 0], banned_ids_per_row=[[10], [10]]))
    assert out.token_ids.tolist() == [11, 11]


def test_top_k_one_and_zero_probability_never_drawn():
    logits = make_logits(64, 1000, seed=4, kind="flat")
    p = SamplingParams(temperature=1.5, top_k=3)
    out = Sampler()(logits, SamplingBatch.build([p] * 64, list(range(64)), need_logprobs=True))
    top3 = torch.topk(logits, 3, dim=-1).indices
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(out.token_ids))
    assert bool((out.token_ranks <= 3).all())
    one = Sampler()(logits, SamplingBatch.build([SamplingParams(top_k=1)] * 64, list(range(64))))
    assert torch.equal(one.token_ids, logits.argmax(-1))


def test_logprobs_output_shapes_and_values():
    logits = make_logits(3, 500, seed=6)
    params = [SamplingParams(logprobs=2, seed=1), SamplingParams(temperature=0), SamplingParams(logprobs=5, seed=2)]
    out = Sampler()(logits, SamplingBatch.build(params, [0, 1, 2]))
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    lp = Sampler().processed_logprobs(logits, SamplingBatch.build(params, [0, 1, 2]))
    assert torch.equal(out.top_logprobs, torch.topk(lp, 5, dim=-1).values)
    for i in range(3):
        assert float(out.logprobs[i]) == float(lp[i, out.token_ids[i]])
    # Greedy rows report the processed (T = 1e-5) distribution: the argmax has logprob ~0.
    assert float(out.logprobs[1]) == pytest.approx(0.0, abs=1e-6)
    none = Sampler()(logits, SamplingBatch.build([SamplingParams(seed=1)] * 3, [0, 1, 2]))
    assert none.logprobs is None and none.top_ids is None
    zero = Sampler()(logits, SamplingBatch.build([SamplingParams(seed=1, logprobs=0)] * 3, [0, 1, 2]))
    assert zero.logprobs is not None and zero.top_ids is None


def test_packed_and_dense_draws_agree():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(8, 4000, generator=g)
    probs[probs < 0.97] = 0.0  # ~3% nonzero: the packed path
    u = torch.rand(8, dtype=torch.float64, generator=g)
    assert torch.equal(sample_from_probs(probs, u, sparse=True), sample_from_probs(probs, u, sparse=False))
    lp = probs.log()
    assert torch.equal(sample_from_logprobs(lp, u, sparse=True), sample_from_logprobs(lp, u, sparse=False))
    assert torch.equal(sample_from_logprobs(lp, u, sparse=False), sample_from_probs(lp.exp(), u, sparse=False))


def test_draw_never_lands_on_trailing_zero_probability():
    probs = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    # u = 1 (outside [0, 1)) forces u * cdf_last == cdf_last, the rounding edge the guard covers.
    u = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert sample_from_probs(probs, u, sparse=False).tolist() == [2, 2]
    assert sample_from_probs(probs, u, sparse=True).tolist() == [2, 2]
    zero_u = torch.zeros(2, dtype=torch.float64)
    assert sample_from_probs(probs, zero_u, sparse=False).tolist() == [0, 2]


def test_build_validates_lengths():
    with pytest.raises(ValueError, match="sample_positions must have one entry per row"):
        SamplingBatch.build([SamplingParams()] * 2, [0])
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([SamplingParams()], [0], seeds=[1, 2])
    with pytest.raises(ValueError, match=r"logits must be \[1, V\]"):
        Sampler()(torch.zeros(2, 10), SamplingBatch.build([SamplingParams()], [0]))


def test_greedy_rows_take_the_heads_argmax_unless_the_logits_were_changed():
    """Sampler.forward(row_argmax=...): the LM head's argmax (layers/head_gemm.py head_logits_argmax)
    stands for the greedy rows' scan of the same logits; a ban, a penalty or a bias changes the rows,
    so the sampler scans them again. The ids given here differ from the logits' argmax on purpose, to
    see which one was used."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    scan = logits.argmax(-1)
    given = (scan + 1) % 50
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)
    sampler = Sampler()

    def run(params, **kw):
        batch = SamplingBatch.build(params, [0] * len(params), seeds=[0] * len(params), **kw)
        return sampler.forward(logits, batch, row_argmax=given).token_ids

    assert torch.equal(run([greedy] * 3), given)
    mixed = run([greedy, sampled, greedy])
    assert mixed[0] == given[0] and mixed[2] == given[2]
    banned = run([greedy] * 3, banned_ids_per_row=[[], [int(given[1])], []])
    assert torch.equal(banned, scan)   # a ban in the batch: its greedy rows are scanned
    penalised = run([SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 3,
                    prompt_ids_per_row=[[1], [2], [3]])
    assert not torch.equal(penalised, given)   # adjusted logits: every row scanned
    with pytest.raises(ValueError, match="row_argmax"):
        sampler.greedy_tokens(logits, SamplingBatch.build([greedy] * 3, [0] * 3, seeds=[0] * 3), given[:2])

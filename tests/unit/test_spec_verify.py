"""spec_verify.verify: greedy equals plain greedy, the sampled rule keeps the target distribution
(with wrong rules as negative controls), batch independence, filters, determinism, and a
sequential reference of docs/model.md §6.4."""
import math
import random

import pytest
import torch

from deepinfer.spec import verify as spec_verify
from deepinfer.model_executor.layers.sample_draw import (
    CASE_RESAMPLE, sample_from_probs, sample_uniforms, verify_uniforms)
from deepinfer.model_executor.layers.sampler import Sampler, SamplingBatch
from deepinfer.spec.proposer import DRAFT_SEED_OFFSET
from deepinfer.spec.verify import NO_TOKEN, VerifyBatch, verify
from deepinfer.sampling_params import SamplingParams

from tests.support.verify_cases import mixed_case

CHI2_DF5_999 = 20.515  # chi-square 0.999 quantiles: 5 degrees of freedom (V = 6),
CHI2_DF3_999 = 16.266  # and 3 (4 tokens left after top-k)
TV_BOUND = 0.02  # sampling noise at 20k trials is ~0.006 (E|freq - p| summed / 2)

P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05], dtype=torch.float64)
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30], dtype=torch.float64)


def draft_draws(probs: torch.Tensor, seeds, positions) -> torch.Tensor:
    """Drafts drawn from `probs` [N, V] on the drafter's own stream (seed + DRAFT_SEED_OFFSET)."""
    u = torch.from_numpy(sample_uniforms([s + DRAFT_SEED_OFFSET for s in seeds], positions))
    return sample_from_probs(probs, u, sparse=False)


def tv_and_chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    n = float(counts.sum())
    freq = counts / n
    tv = 0.5 * float((freq - p).abs().sum())
    support = p > 0
    # Tokens off the support are not in chi2; they add their whole frequency to tv.
    chi2 = float(((counts[support] - n * p[support]) ** 2 / (n * p[support])).sum())
    return tv, chi2


def run_trials(n: int, num_drafts: int, p: torch.Tensor, q: torch.Tensor | None, pos: int = 11,
               params: SamplingParams | None = None, fixed_draft: int | None = None):
    """n requests (seeds 0..n-1) with context-free target logits log p and drafts from q."""
    params = params or SamplingParams(temperature=1.0)
    seeds = list(range(n))
    logits = p.log().float().expand(n, num_drafts + 1, p.numel())
    drafts = torch.empty(n, num_drafts, dtype=torch.int64)
    for j in range(num_drafts):
        if fixed_draft is not None:
            drafts[:, j] = fixed_draft
        else:
            drafts[:, j] = draft_draws(q.expand(n, -1), seeds, [pos + j] * n)
    draft_lp = None if q is None else q.log().float().expand(n, num_drafts, q.numel())
    batch = VerifyBatch.build([params] * n, [pos] * n, num_drafts, seeds=seeds)
    return logits, drafts, draft_lp, batch


# ---- (1) greedy ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_drafts", [0, 1, 4])
def test_greedy_equals_plain_greedy_for_every_acceptance_length(num_drafts):
    torch.manual_seed(0)
    vocab, b = 50, num_drafts
    r = b + 1  # request k rejects at depth k (k = B: all accepted)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3) for _ in range(r)]
    logits = torch.randn(r, b + 1, vocab) * 3
    raw_top = logits.argmax(-1)
    # Ban the raw argmax on some rows and penalise a token on all: the draft must match the
    # processed argmax, not the raw one.
    banned = [[int(raw_top[i, j])] if (i + j) % 2 else [] for i in range(r) for j in range(b + 1)]
    prompts = [[int(raw_top[i, 0]) ^ 1] for i in range(r)]
    flat_params = [p for p in params for _ in range(b + 1)]
    positions = [5 + j for _ in range(r) for j in range(b + 1)]
    plain = Sampler()(logits.reshape(-1, vocab), SamplingBatch.build(
        flat_params, positions, banned_ids_per_row=banned,
        prompt_ids_per_row=[prompts[i] for i in range(r) for _ in range(b + 1)])).token_ids.reshape(r, b + 1)
    assert not torch.equal(plain, raw_top) or b == 0  # the bans matter
    drafts = plain[:, :b].clone()
    for k in range(r):
        if k < b:
            drafts[k, k] = (plain[k, k] + 1) % vocab
            drafts[k, k + 1:] = torch.randint(vocab, (b - k - 1,))
    batch = VerifyBatch.build(params, [5] * r, b, banned_ids_per_row=banned, prompt_ids_per_row=prompts)
    junk_q = torch.log_softmax(torch.randn(r, b, vocab), -1)  # greedy requests ignore it
    out = verify(logits, drafts, junk_q, batch)
    assert out.num_accepted.tolist() == list(range(r))
    for k in range(r):
        assert out.token_ids[k, :k + 1].tolist() == plain[k, :k + 1].tolist()
        assert (out.token_ids[k, k + 1:] == NO_TOKEN).all()
    assert torch.equal(verify(logits, drafts, None, batch).token_ids, out.token_ids)


# ---- (2) the sampled rule preserves the target distribution -------------------------------
def wrong_resample_from_p(p, q, alpha):
    return p


def wrong_residual_q_minus_p(p, q, alpha):
    return torch.clamp(q - p, min=0.0)


def wrong_ratio_q_over_p(target_lp, draft_lp):
    return torch.exp(torch.clamp(draft_lp.double() - target_lp.double(), max=0.0))


def wrong_always_accept(target_lp, draft_lp):
    return torch.ones_like(target_lp, dtype=torch.float64)


# p/q without the min is not a control: u < 1 always, so u < p/q is the same test.
NEGATIVE_CONTROLS = {
    "resample from p": ("residual", wrong_resample_from_p),
    "residual max(q - p, 0)": ("residual", wrong_residual_q_minus_p),
    "accept with q/p": ("acceptance_probability", wrong_ratio_q_over_p),
    "always accept": ("acceptance_probability", wrong_always_accept),
}


def emitted_distance(n=20000, num_drafts=2, **kw):
    out = verify(*run_trials(n, num_drafts, P, Q, **kw))
    first = out.token_ids[:, 0]
    second = out.token_ids[out.num_emitted >= 2, 1]
    return out, tv_and_chi2(first, P), tv_and_chi2(second, P)


def test_sampled_rule_keeps_target_distribution_and_wrong_rules_fail(monkeypatch):
    out, (tv, chi2), (tv2, chi2_2) = emitted_distance()
    accept_rate = float((out.num_accepted >= 1).double().mean())
    expected_rate = float(torch.minimum(P, Q).sum())  # P(accept d_0) = sum min(p, q)
    print(f"right rule: first token TV {tv:.4f} chi2 {chi2:.2f}; second TV {tv2:.4f} chi2 {chi2_2:.2f};"
          f" accept {accept_rate:.4f} (expected {expected_rate:.4f})")
    assert tv < TV_BOUND and chi2 < CHI2_DF5_999
    assert tv2 < TV_BOUND and chi2_2 < CHI2_DF5_999
    assert abs(accept_rate - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / 20000)
    for name, (attr, wrong) in NEGATIVE_CONTROLS.items():
        with monkeypatch.context() as m:
            m.setattr(spec_verify, attr, wrong)
            _, (bad_tv, bad_chi2), _ = emitted_distance()
        print(f"negative control {name!r}: TV {bad_tv:.4f} chi2 {bad_chi2:.1f}")
        assert bad_tv > 3 * TV_BOUND and bad_chi2 > 10 * CHI2_DF5_999, name


@pytest.mark.parametrize("alpha", [spec_verify.DRAFT_PROB_PENALTY, 1.0])
def test_textbook_and_penalised_residual_both_keep_the_distribution(alpha):
    out = verify(*run_trials(20000, 1, P, Q, pos=3), draft_prob_penalty=alpha)
    tv, chi2 = tv_and_chi2(out.token_ids[:, 0], P)
    assert tv < TV_BOUND and chi2 < CHI2_DF5_999


def test_processed_distribution_is_the_target():
    # Temperature, top-k and a min_tokens ban: the emitted token follows the processed p, while
    # the draft proposes from a q that ignores every filter.
    params = SamplingParams(temperature=0.7, top_k=4)
    raw = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.2])
    n, b, pos = 20000, 2, 9
    banned = [[1] for _ in range(n * (b + 1))]
    p = Sampler().processed_logprobs(raw.unsqueeze(0), SamplingBatch.build(
        [params], [pos], banned_ids_per_row=[[1]])).exp().double().squeeze(0)
    assert p[1] == 0 and (p > 0).sum() == 4
    seeds = list(range(n))
    drafts = torch.stack([draft_draws(Q.expand(n, -1), seeds, [pos + j] * n) for j in range(b)], 1)
    batch = VerifyBatch.build([params] * n, [pos] * n, b, seeds=seeds, banned_ids_per_row=banned)
    out = verify(raw.expand(n, b + 1, 6), drafts, Q.log().float().expand(n, b, 6), batch)
    tv, chi2 = tv_and_chi2(out.token_ids[:, 0], p)
    assert tv < TV_BOUND and chi2 < CHI2_DF3_999
    emitted = out.token_ids[out.token_ids >= 0]
    assert not torch.isin(emitted, (p == 0).nonzero().squeeze(1)).any()


def test_deterministic_draft_without_logprobs_keeps_distribution():
    # draft_logprobs=None: q is one-hot on the draft (a greedy drafter); always drafting token 5.
    out = verify(*run_trials(20000, 1, P, None, fixed_draft=5))
    tv, chi2 = tv_and_chi2(out.token_ids[:, 0], P)
    assert tv < TV_BOUND and chi2 < CHI2_DF5_999
    assert abs(float((out.num_accepted == 1).double().mean()) - float(P[5])) < 0.01


# ---- sequential reference -----------------------------------------------------------------
def reference_request(logits, drafts, draft_lp, params, seed, pos, alpha):
    """§6.4 for one request, depth by depth, with the sampler's processed rows."""
    b = drafts.numel()
    out = []
    for j in range(b + 1):
        row = SamplingBatch.build([params], [pos + j], seeds=[seed])
        lp = Sampler().processed_logprobs(logits[j:j + 1], row).squeeze(0)
        if params.is_greedy:
            top = int(Sampler()(logits[j:j + 1], row).token_ids)
            out.append(top)
            if j == b or int(drafts[j]) != top:
                return j, out
            continue
        d = int(drafts[j]) if j < b else -1
        if d >= 0:
            u = float(verify_uniforms([seed], [pos + j])[0])
            if math.exp(min(0.0, float(lp[d]) - float(draft_lp[j, d]))) > u:
                out.append(d)
                continue
            res = torch.clamp(lp.exp() - alpha * draft_lp[j].exp(), min=0.0)
            u = sample_uniforms([seed], [pos + j], CASE_RESAMPLE)
            out.append(int(sample_from_probs(res.unsqueeze(0), torch.from_numpy(u))))
        else:
            out.append(int(sample_from_probs(lp.exp().unsqueeze(0),
                                             torch.from_numpy(sample_uniforms([seed], [pos + j])))))
        return j, out
    raise AssertionError("unreachable")


def test_batched_equals_sequential_reference():
    params, logits, drafts, draft_lp = mixed_case()
    r, b = drafts.shape
    seeds = [1000 + 17 * i for i in range(r)]
    positions = [3 + i % 5 for i in range(r)]
    out = verify(logits, drafts, draft_lp, VerifyBatch.build(params, positions, b, seeds=seeds))
    lengths = set()
    for i in range(r):
        acc, toks = reference_request(logits[i], drafts[i], draft_lp[i], params[i], seeds[i],
                                      positions[i], spec_verify.DRAFT_PROB_PENALTY)
        assert int(out.num_accepted[i]) == acc, i
        assert out.token_ids[i, :acc + 1].tolist() == toks, i
        assert (out.token_ids[i, acc + 1:] == NO_TOKEN).all()
        lengths.add(acc)
    assert lengths == set(range(b + 1))  # every acceptance length occurred


# ---- (3) batch independence ---------------------------------------------------------------
def test_request_output_is_independent_of_its_batch():
    params, logits, drafts, draft_lp = mixed_case(r=25, seed=1)
    r, b = drafts.shape
    seeds = [50 + i for i in range(r)]
    positions = [7] * r
    kw = dict(need_logprobs=True)
    whole = verify(logits, drafts, draft_lp, VerifyBatch.build(params, positions, b, seeds=seeds, **kw))
    perm = torch.randperm(r, generator=torch.Generator().manual_seed(3))
    shuffled = verify(logits[perm], drafts[perm], draft_lp[perm], VerifyBatch.build(
        [params[i] for i in perm], positions, b, seeds=[seeds[i] for i in perm], **kw))
    assert torch.equal(shuffled.token_ids, whole.token_ids[perm])
    assert torch.equal(shuffled.logprobs, whole.logprobs[perm])
    for i in range(r):
        alone = verify(logits[i:i + 1], drafts[i:i + 1], draft_lp[i:i + 1],
                       VerifyBatch.build([params[i]], [7], b, seeds=[seeds[i]], **kw))
        assert torch.equal(alone.token_ids[0], whole.token_ids[i]), i
        assert torch.equal(alone.num_accepted[0], whole.num_accepted[i])
        assert torch.equal(alone.logprobs[0], whole.logprobs[i])


def test_missing_drafts_equal_a_shorter_block():
    params, logits, drafts, draft_lp = mixed_case(r=40, b=3, seed=2)
    seeds = list(range(40))
    drafts[:, 1:] = NO_TOKEN
    long = verify(logits, drafts, draft_lp, VerifyBatch.build(params, [4] * 40, 3, seeds=seeds))
    short = verify(logits[:, :2], drafts[:, :1], draft_lp[:, :1],
                   VerifyBatch.build(params, [4] * 40, 1, seeds=seeds))
    assert torch.equal(long.num_accepted, short.num_accepted)
    assert torch.equal(long.token_ids[:, :2], short.token_ids)
    assert (long.token_ids[:, 2:] == NO_TOKEN).all()


def test_no_drafts_is_plain_sampling_and_full_acceptance_gives_the_plain_bonus():
    params, logits, _, _ = mixed_case(r=30, b=2, seed=4)
    seeds = [9 + i for i in range(30)]
    plain_batch = SamplingBatch.build(params, [6] * 30, seeds=seeds, need_logprobs=True)
    plain = Sampler()(logits[:, 0], plain_batch)
    none = verify(logits[:, :1], torch.empty(30, 0, dtype=torch.int64), None,
                  VerifyBatch.build(params, [6] * 30, 0, seeds=seeds, need_logprobs=True))
    assert torch.equal(none.token_ids[:, 0], plain.token_ids)
    assert torch.equal(none.logprobs[:, 0], plain.logprobs)
    # q = p exactly: every draft is accepted and the bonus is the plain sampler's token at pos + 2.
    vb = VerifyBatch.build(params, [4] * 30, 2, seeds=seeds)
    p_lp = Sampler().processed_logprobs(logits.reshape(90, -1), vb.sampling).reshape(30, 3, -1)
    g = torch.Generator().manual_seed(4)
    drafts = torch.stack([sample_from_probs(p_lp[:, j].exp(),
                                            torch.rand(30, dtype=torch.float64, generator=g))
                          for j in range(2)], 1)
    out = verify(logits, drafts, p_lp[:, :2], vb)
    assert (out.num_accepted == 2).all()
    bonus = Sampler()(logits[:, 2], SamplingBatch.build(params, [6] * 30, seeds=seeds)).token_ids
    assert torch.equal(out.token_ids[:, 2], bonus)


# ---- (4) filters and bans -----------------------------------------------------------------
@pytest.mark.parametrize("with_q", [True, False])
def test_filtered_and_banned_tokens_are_never_emitted(with_q):
    n, b, vocab = 1500, 3, 64
    g = torch.Generator().manual_seed(5)
    kinds = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, top_p=0.7),
             SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.0),
             SamplingParams(temperature=2.0, top_k=10, top_p=0.9)]
    params = [kinds[i % len(kinds)] for i in range(n)]
    logits = torch.randn(n, b + 1, vocab, generator=g)
    banned = [[int(logits[i // (b + 1), i % (b + 1)].argmax()), 3] for i in range(n * (b + 1))]
    # The drafter ignores every filter: uniform q, drafts often filtered or banned.
    q_lp = torch.full((n, b, vocab), -math.log(vocab))
    drafts = torch.randint(vocab, (n, b), generator=g)
    drafts[::3, 0] = 3  # always banned
    batch = VerifyBatch.build(params, [2] * n, b, seeds=list(range(n)), banned_ids_per_row=banned)
    out = verify(logits, drafts, q_lp if with_q else None, batch)
    processed = Sampler().processed_logprobs(logits.reshape(-1, vocab), batch.sampling)
    allowed = processed.reshape(n, b + 1, vocab) > -math.inf
    emitted = out.token_ids >= 0
    assert emitted.sum() > n  # some drafts were accepted
    assert (out.num_emitted == emitted.sum(1)).all()
    picked = allowed.gather(2, out.token_ids.clamp(min=0).unsqueeze(2)).squeeze(2)
    assert picked[emitted].all()
    assert (out.num_accepted[::3] == 0).all()


# ---- (5) determinism ----------------------------------------------------------------------
def test_deterministic_for_a_seed_and_different_across_seeds():
    params, logits, drafts, draft_lp = mixed_case(r=40, seed=6)
    b = drafts.shape[1]

    def run(seeds, rng=None):
        return verify(logits, drafts, draft_lp, VerifyBatch.build(params, [8] * 40, b, seeds=seeds, rng=rng))

    a, again = run(list(range(40))), run(list(range(40)))
    assert torch.equal(a.token_ids, again.token_ids) and torch.equal(a.num_accepted, again.num_accepted)
    other = run([s + 12345 for s in range(40)])
    sampled = torch.tensor([not p.is_greedy for p in params])
    assert not torch.equal(a.token_ids[sampled], other.token_ids[sampled])
    assert torch.equal(a.token_ids[~sampled], other.token_ids[~sampled])  # greedy ignores seeds
    # Unseeded requests take their seed from rng: reproducible for a seeded rng.
    u1, u2 = run([None] * 40, random.Random(7)), run([None] * 40, random.Random(7))
    assert torch.equal(u1.token_ids, u2.token_ids)


def test_shape_errors():
    batch = VerifyBatch.build([SamplingParams()], [0], 2, seeds=[1])
    with pytest.raises(ValueError, match="target_logits"):
        verify(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.int64), None, batch)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(torch.zeros(1, 3, 5), torch.zeros(1, 1, dtype=torch.int64), None, batch)
    with pytest.raises(ValueError, match="vocab"):
        verify(torch.zeros(1, 3, 5), torch.full((1, 2), 5, dtype=torch.int64), None, batch)
    with pytest.raises(ValueError, match="draft_logprobs"):
        verify(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, 4), batch)
    with pytest.raises(ValueError, match="num_drafts"):
        VerifyBatch.build([SamplingParams()], [0], -1)


def test_rejection_with_an_empty_residual_falls_back_to_p():
    # q = p except q(d) = 2 p(d) (only rounding gets this close in practice): with the textbook
    # residual, max(p - q, 0) has no mass, yet d is rejected half the time.
    n, vocab, d = 400, 8, 4
    lp = torch.log_softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(8)), -1)
    lp[0] = -math.inf  # banned below, so a draw from an all-zero row (index 0) would show
    batch = VerifyBatch.build([SamplingParams()] * n, [1] * n, 1, seeds=list(range(n)),
                              banned_ids_per_row=[[0]] * (2 * n))
    # The processed p bit for bit, so p - q is exactly 0 off d.
    q_lp = Sampler().processed_logprobs(lp.unsqueeze(0), batch.sampling, torch.tensor([0])).squeeze(0)
    q_lp[d] += math.log(2.0)
    out = verify(lp.expand(n, 2, vocab), torch.full((n, 1), d), q_lp.expand(n, 1, vocab), batch,
                 draft_prob_penalty=1.0)
    rejected = out.num_accepted == 0
    assert 100 < int(rejected.sum()) < 300
    assert (out.token_ids[rejected, 0] != 0).all()


def test_verification_logits_are_a_view_only_when_the_rows_follow_one_another():
    """spec/decoder._target_view: the [R, B + 1, V] target is a view of the step's logits when every
    request has B drafts and their rows are consecutive (no copy), else None (the rows are gathered)."""
    from deepinfer.spec.decoder import _target_view
    logits = torch.randn(9, 11)
    view = _target_view(logits, [(0, 1), (1, 5)], [3, 3], 3)   # rows 1-4 and 5-8
    assert view is not None and view.data_ptr() == logits[1].data_ptr()
    assert torch.equal(view, logits[1:9].reshape(2, 4, 11))
    assert _target_view(logits, [(0, 1), (1, 5)], [3, 2], 3) is None   # a request with fewer drafts
    assert _target_view(logits, [(0, 0), (2, 5)], [3, 3], 3) is None   # a plain row between them
    assert _target_view(logits.t().contiguous().t(), [(0, 1)], [3], 3) is None   # not row-contiguous

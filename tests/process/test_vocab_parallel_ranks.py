"""The LM head split by vocabulary over the CP group and the shared expert split over the lane's part
of the EP group (layers/vocab_parallel.py, layers/ep_moe.py), across real processes (gloo): greedy, seeded top-k /
top-p sampling and logprobs through the real ModelRunner equal one rank's; the candidate route gives
bit for bit what the Sampler gives on the same step's whole rows; each rank holds only its slices;
a candidate step's only head collective is the candidates' all-gather, and the shared expert adds
no collective."""
import math

import pytest
import torch

from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.model_executor.layers.vocab_parallel import head_plan
from deepinfer.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from tests.support.rank_spawn import Job, expected_collectives, reference, run_ranks

P = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 1000, 20, 21]]
Q = [[50, 170, 30, 4200, 90, 110], [70, 80, 90, 100, 200, 210]]
TOL = 1e-4   # fp32 logits: the ranks' partial sums change only the summation order

TOP_K_LOGPROBS = [SamplingParams(temperature=0.8, top_k=5, seed=1, logprobs=3),
                  SamplingParams(temperature=1.2, top_k=20, seed=2, logprobs=0, min_p=0.02)]
GREEDY_AND_TOP_K = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=8, seed=3)]
WHOLE_VOCAB = [SamplingParams(temperature=0.9, top_p=0.9, seed=4, logprobs=2), SamplingParams(temperature=0.0)]


@pytest.fixture(scope="module")
def jobs(tiny_v41_l4_dir, tiny_v4_l3_dir):
    d41, d4 = str(tiny_v41_l4_dir), str(tiny_v4_l3_dir)
    return {
        "cp2_lanes2_v41_top_k_logprobs": Job(d41, cp=2, attn_tp=2, prompts=[P], weight_format="packed",
                                             sampling=TOP_K_LOGPROBS, record=True),
        "cp2_lanes2_v41_whole_vocab": Job(d41, cp=2, attn_tp=2, prompts=[P], weight_format="packed",
                                          sampling=WHOLE_VOCAB),
        "ep2_v41_greedy_top_k": Job(d41, ep=2, prompts=[P, Q], weight_format="packed", sampling=GREEDY_AND_TOP_K,
                                    record=True),
        "cp2_ep2_lanes2_v4_greedy_top_k": Job(d4, cp=2, ep=2, attn_tp=2, prompts=[P], weight_format="packed",
                                              sampling=GREEDY_AND_TOP_K, record=True),
    }


@pytest.fixture(scope="module")
def two_ranks(jobs):
    return dict(zip(jobs, zip(jobs.values(), run_ranks(2, list(jobs.values())))))


def _same(a: dict, b: dict, where: str, exact: bool, temps=None) -> None:
    """exact: bit for bit; else logprobs within TOL x (1/T) of their row (a logit error reaches a
    logprob divided by the temperature: a greedy row's 1e-5 turns 1e-6 into 0.1)."""
    assert a["token_ids"].tolist() == b["token_ids"].tolist(), where
    for name in ("token_ranks", "top_ids"):
        assert (a[name] is None) == (b[name] is None), where
        if a[name] is not None:
            assert a[name].tolist() == b[name].tolist(), (where, name)
    for name in ("logprobs", "top_logprobs"):
        assert (a[name] is None) == (b[name] is None), where
        if a[name] is not None:
            if exact:
                ok = a[name].equal(b[name])
            else:
                err = (a[name] - b[name]).abs().reshape(len(temps), -1).amax(dim=1)
                ok = bool((err * torch.tensor(temps) < TOL).all())
            assert ok, (where, name)


def _candidate_collectives(job: Job, got: dict) -> list[tuple]:
    """One decode step of a candidate plan: the layers' collectives, then the head's candidates."""
    shapes = got["state_dict_shapes"]
    layers = sum(1 for k in shapes if k.startswith("layers.") and k.endswith(".attn_norm.weight"))
    rows = len(job.prompts[0])
    per_step = expected_collectives(job, layers, rows, shapes["norm.weight"][0], shapes["embed.weight"][0])
    if job.cp == 1:
        return per_step
    m = head_plan(job.sampling).count
    return per_step[:-1] + [("all_gather", job.cp, rows * 2 * m * 4)]


@pytest.fixture(scope="module")
def four_ranks(tiny_v41_l4_dir):
    """cp 2 x ep 4: two data-parallel groups, the EP group spanning them (all-gather + reduce-scatter),
    the shared expert over lanes of 2 weighted 1/2 in the reduce-scatter."""
    job = Job(str(tiny_v41_l4_dir), cp=2, ep=4, attn_tp=2, prompts=[P, Q], weight_format="packed",
              sampling=TOP_K_LOGPROBS, record=True)
    return job, run_ranks(4, [job])[0]


@pytest.mark.parametrize("name", ["cp2_lanes2_v41_top_k_logprobs", "cp2_lanes2_v41_whole_vocab",
                                  "ep2_v41_greedy_top_k", "cp2_ep2_lanes2_v4_greedy_top_k"])
def test_sampling_equals_one_rank(two_ranks, name):
    _check(name, *two_ranks[name])


def test_cp2_ep4_sampling_equals_one_rank(four_ranks):
    _check("cp2_ep4_lanes2_v41_top_k_logprobs", *four_ranks)


def _check(name: str, job: Job, ranks: list[dict]) -> None:
    want = reference(job)
    for rank, got in enumerate(ranks):
        layout = ParallelLayout(rank=rank, cp=job.cp, ep=job.ep, attn_tp=job.attn_tp)
        ref = want[layout.dp_rank]
        where = f"{name} rank {rank}"
        assert got["tokens"] == ref["tokens"], where
        for step, (a, whole, b) in enumerate(zip(got["sampled"], got["whole_sampled"], ref["sampled"])):
            _same(a, whole, f"{where} step {step} (whole rows)", exact=True)
            _same(a, b, f"{where} step {step} (one rank)", exact=False,
                  temps=[GREEDY_TEMPERATURE if p.is_greedy else p.temperature for p in job.sampling])
        shapes = got["state_dict_shapes"]
        vocab = shapes["embed.weight"][0]
        assert shapes["head.weight"] == (vocab // job.cp, shapes["norm.weight"][0]), where
        held = 128 // math.gcd(job.attn_tp, job.ep)   # the tiny models' shared expert, over the lane in the EP group
        assert shapes["layers.0.ffn.shared_experts.w1.weight"][0] == held, where
        assert shapes["layers.0.ffn.shared_experts.w2.weight"][1] == held, where
        if job.record:
            expect = _candidate_collectives(job, got)
            assert [(e["op"], e["group_size"]) for e in got["records"]] == [(op, n) for op, n, _ in expect], where
            assert all(b is None or e["bytes"] == b for e, (_, _, b) in zip(got["records"], expect)), where


def test_the_plans_are_what_the_jobs_mean_to_exercise():
    assert head_plan(TOP_K_LOGPROBS).count == 20 and head_plan(GREEDY_AND_TOP_K).count == 8
    assert head_plan(WHOLE_VOCAB) is None

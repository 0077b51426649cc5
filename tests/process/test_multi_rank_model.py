"""One model across real processes (gloo, env:// on a free port): attention lanes and expert
parallelism give the single-rank logits and greedy tokens (docs/neuron.md §5.5, §5.6).

Each spawn runs several layouts in turn (tests/support/rank_spawn.py): every rank builds the model with
`build_model(..., parallel=groups)` from the checkpoint (reading only its slices) and drives the real
ModelRunner through a prompt step and greedy decode steps. With ep > cp each data-parallel group
runs different prompts with the same token counts (the process side pads to equal rows)."""
import pytest

from deepinfer.distributed.parallel_layout import ParallelLayout
from tests.support.rank_spawn import Job, expected_collectives, reference, run_ranks

# Same lengths in every data-parallel group (equal step rows on every EP member).
P = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 1000, 20, 21]]
Q = [[50, 170, 30, 4200, 90, 110], [70, 80, 90, 100, 200, 210]]
R = [[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]]
S = [[11, 22, 33, 44, 55, 66], [77, 88, 99, 111, 222, 333]]
TOL = 1e-4   # fp32: only the summation order of the partial outputs differs


@pytest.fixture(scope="module")
def v41_dir(tiny_v41_l4_dir):
    return str(tiny_v41_l4_dir)


@pytest.fixture(scope="module")
def v4_dir(tiny_v4_l3_dir):
    """fp8 128x128 blocks: a 64-row o-group of wo_a lies inside one block."""
    return str(tiny_v4_l3_dir)


def _check(job: Job, ranks: list[dict]) -> None:
    want = reference(job)
    for rank, got in enumerate(ranks):
        layout = ParallelLayout(rank=rank, cp=job.cp, ep=job.ep, attn_tp=job.attn_tp)
        ref = want[layout.dp_rank]
        where = f"{job} rank {rank}"
        assert got["tokens"] == ref["tokens"], where
        for step, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
            assert a.shape == b.shape, where
            assert (a - b).abs().max().item() < TOL, f"{where} step {step}"
        if job.record:
            layers = sum(1 for k in got["state_dict_shapes"] if k.startswith("layers.") and k.endswith(".attn_norm.weight"))
            dim = got["state_dict_shapes"]["norm.weight"][0]
            vocab = got["state_dict_shapes"]["embed.weight"][0]
            expect = expected_collectives(job, layers, rows=len(job.prompts[layout.dp_rank]), dim=dim, vocab=vocab)
            assert len(got["records"]) == len(expect), (where, got["records"])
            for entry, (op, size, nbytes) in zip(got["records"], expect):
                assert (entry["op"], entry["group_size"]) == (op, size), (where, got["records"])
                assert nbytes is None or entry["bytes"] == nbytes, (where, entry)


def _check_shards(job: Job, ranks: list[dict], heads: int, experts: int) -> None:
    """Each rank holds only its heads' rows and its experts."""
    for rank, got in enumerate(ranks):
        shapes = got["state_dict_shapes"]
        assert shapes["layers.0.attn.wq_b.weight"][0] == 128 * heads // job.attn_tp
        assert shapes["layers.0.attn.attn_sink"] == (heads // job.attn_tp,)
        held = sorted(int(k.split(".")[4]) for k in shapes
                      if k.startswith("layers.0.ffn.experts.") and k.endswith(".w1.weight"))
        per = experts // job.ep
        first = ParallelLayout(rank=rank, cp=job.cp, ep=job.ep, attn_tp=job.attn_tp).ep_rank * per
        assert held == list(range(first, first + per))


TWO = {
    # grouped by (checkpoint, weight format): the single-rank reference model is loaded once per group
    "ep2_v41_dense": lambda d, d4: Job(d, ep=2, prompts=[P, Q], weight_format="dense", record=True),
    "cp2_lanes2_v41_packed": lambda d, d4: Job(d, cp=2, attn_tp=2, prompts=[P], weight_format="packed"),
    "cp2_ep2_lanes2_v41_packed": lambda d, d4: Job(d, cp=2, ep=2, attn_tp=2, prompts=[P], weight_format="packed",
                                                  record=True),
    "cp2_ep2_lanes2_v4_packed": lambda d, d4: Job(d4, cp=2, ep=2, attn_tp=2, prompts=[P], weight_format="packed"),
    # host-mode Neuron region graphs (aot_eager, fullgraph): the dispatch all-gather and the
    # reduce-scatter inside compiled regions, placeholder rows in the padded prompt step, which takes
    # the capacity-bounded expert form (torch.cond on the max-all-reduced overflow flag); the decode
    # step the dense form
    "ep2_v4_packed_neuron_regions": lambda d, d4: Job(d4, ep=2, prompts=[P, Q], weight_format="packed",
                                                     strategy="neuron", steps=2, capacity=32),
}
FOUR = {
    "cp4_ep4_lanes4_v41_dense": lambda d: Job(d, cp=4, ep=4, attn_tp=4, prompts=[P], weight_format="dense",
                                              record=True),
    "cp4_lanes2_v41_packed": lambda d: Job(d, cp=4, attn_tp=2, prompts=[P], weight_format="packed"),
    "ep4_v41_packed": lambda d: Job(d, ep=4, prompts=[P, Q, R, S], weight_format="packed"),
    "cp2_ep4_lanes2_v41_packed": lambda d: Job(d, cp=2, ep=4, attn_tp=2, prompts=[P, Q], weight_format="packed",
                                               record=True),
}


@pytest.fixture(scope="module")
def two_ranks(v41_dir, v4_dir):
    jobs = {name: make(v41_dir, v4_dir) for name, make in TWO.items()}
    return dict(zip(jobs, zip(jobs.values(), run_ranks(2, list(jobs.values())))))


@pytest.fixture(scope="module")
def four_ranks(v41_dir):
    jobs = {name: make(v41_dir) for name, make in FOUR.items()}
    return dict(zip(jobs, zip(jobs.values(), run_ranks(4, list(jobs.values())))))


@pytest.mark.parametrize("name", TWO)
def test_two_ranks(two_ranks, name):
    job, ranks = two_ranks[name]
    _check(job, ranks)
    if job.ep > 1 and job.attn_tp > 1:
        _check_shards(job, ranks, heads=4, experts=8)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks(four_ranks, name):
    job, ranks = four_ranks[name]
    _check(job, ranks)
    if job.ep > 1 and job.attn_tp > 1:
        _check_shards(job, ranks, heads=4, experts=8)

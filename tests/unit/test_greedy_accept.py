"""The device's greedy acceptance (spec/greedy_step.py greedy_accept) against the host's (spec/verify.py
verify, the sampler's greedy rows) on logits with exact ties and ties by one ulp: the same tokens and
accepted counts, ties to the lowest id in both, and the plan's rows read back in chunk order."""
import torch

from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.greedy_step import GreedySpecOutput, GreedySpecPlan, greedy_accept
from deepinfer.spec.verify import NO_TOKEN, VerifyBatch, verify
from tests.support.tie_logits import V, near_tie_logits, tie_drafts


def test_device_acceptance_equals_the_host_verification_on_near_ties():
    for b in (1, 3, 5):
        r = 16
        logits = near_tie_logits(r, b + 1, seed=b)
        drafts = tie_drafts(logits, seed=100 + b)
        batch = VerifyBatch.build([SamplingParams(temperature=0.0)] * r, list(range(10, 10 + r)), b)
        host = verify(logits, drafts, None, batch)
        # the device reads the step's logits rows [R * (1 + B), V] through the plan's row indices
        flat = logits.reshape(r * (b + 1), V)
        idx = torch.arange(r * (b + 1)).view(r, b + 1)
        tokens, acc = greedy_accept(flat, idx, drafts)
        assert torch.equal(acc, host.num_accepted), (b, acc, host.num_accepted)
        keep = torch.arange(b + 1)[None, :] <= acc[:, None]
        assert torch.equal(tokens.masked_fill(~keep, NO_TOKEN), host.token_ids)
        assert bool((acc > 0).any()) and bool((acc < b).any())   # both accepted runs and rejections
        # exact ties go to the lower id (torch.argmax's rule, which the sampler's first_argmax keeps)
        assert torch.equal(tokens, logits.argmax(dim=-1))


class _Seq:
    def __init__(self, slot, length):
        self.state_slot, self._len = slot, length

    def __len__(self):
        return self._len


class _Sched:
    def __init__(self, seq, drafts, do_sample=True):
        self.seq, self.draft_token_ids, self.do_sample = seq, drafts, do_sample


def test_plan_rows_name_each_rows_verification_logits_and_parse_back():
    b = 3
    # a prompt chunk that does not sample (no logits rows), a row with 2 drafts, one with none
    scheduled = [_Sched(_Seq(1, 40), [], do_sample=False), _Sched(_Seq(2, 12), [7, 8]), _Sched(_Seq(3, 30), [])]
    chunks = [SeqChunk(slot=1, ctx_len=0, num_new=16, block_table=[1], token_ids=[0] * 40, num_logits=0),
              SeqChunk(slot=2, ctx_len=11, num_new=3, block_table=[2], token_ids=[0] * 14, num_logits=3),
              SeqChunk(slot=3, ctx_len=29, num_new=1, block_table=[3], token_ids=[0] * 30, num_logits=1)]
    plan = GreedySpecPlan.build(scheduled, chunks, b)
    assert plan.index == [1, 2] and plan.first == [0, 3] and plan.x0_pos == [11, 29]
    m = plan.meta(4)
    assert m[0].tolist() == [0, 1, 2, 2, 7, 8, NO_TOKEN, 2, 11, 1]
    assert m[1].tolist() == [3, 3, 3, 3, NO_TOKEN, NO_TOKEN, NO_TOKEN, 3, 29, 1]
    assert m[2:, -1].tolist() == [0, 0] and m[2:, 1 + b:1 + 2 * b].eq(NO_TOKEN).all()
    out = torch.tensor([[7, 8, 5, 9, 2, 11, 12, 13, .5, .25, .125],
                        [4, 0, 0, 0, 0, 21, 22, 23, .9, .8, .7]])
    got = GreedySpecOutput.parse(torch.cat([out, torch.zeros(2, 11)]), 2, b)
    assert got.tokens == [[7, 8, 5], [4]] and got.accepted == [2, 0]
    assert got.drafts == [[11, 12, 13], [21, 22, 23]] and got.confidences[0] == [.5, .25, .125]


def test_a_groups_plan_renumbers_its_rows_as_the_groups_step_has_them():
    """executor/step_fanout.py prepare_greedy_spec: with data-parallel groups each group's step holds its
    own chunks' logits rows one after another, so a plan row's first logits row moves."""
    b = 2
    scheduled = [_Sched(_Seq(1, 12), [7, 8]), _Sched(_Seq(2, 20), [9]), _Sched(_Seq(3, 30), []),
                 _Sched(_Seq(4, 9), [5, 6])]
    chunks = [SeqChunk(slot=s.seq.state_slot, ctx_len=len(s.seq) - 1, num_new=1 + len(s.draft_token_ids),
                       block_table=[1], token_ids=[0] * (len(s.seq) + 2), num_logits=1 + len(s.draft_token_ids))
              for s in scheduled]
    plan = GreedySpecPlan.build(scheduled, chunks, b)
    assert plan.first == [0, 3, 5, 6]
    odd = plan.for_group(chunks, [0, 2])    # slots 1 and 3
    even = plan.for_group(chunks, [1, 3])   # slots 2 and 4
    assert odd.index == [0, 2] and odd.first == [0, 3] and odd.drafts == [[7, 8], []] and odd.slots == [1, 3]
    assert even.index == [1, 3] and even.first == [0, 2] and even.x0_pos == [19, 8]
    # each group's meta names the rows of its own step
    assert even.meta(2)[1, :1 + b].tolist() == [2, 3, 4]
    assert plan.for_group(chunks, []).index == []

"""The ModelRunner's seam to ranks (worker/step_transport.py) and the one step result (step_result.py):
on one rank the runner goes through SingleRankTransport, every phase of a step and of a draft block
passes through its transport, and the no-op form hands back exactly the strategy's logits and the
model's draft rows; a plain and a speculative step both return a StepResult."""
import inspect

import torch

from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.models.dspark_draft import DraftBlock, draft_step_inputs
from deepinfer.sampling_params import SamplingParams
from deepinfer.step_result import StepResult
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.runners import EagerStrategy
from deepinfer.worker.step_transport import SingleRankTransport
from deepinfer.worker.worker import Worker, build_model
from tests.support.model_helpers import tiny_config, tiny_model


class RecordingTransport(SingleRankTransport):
    def __init__(self):
        self.calls = []

    def prepare(self, strategy, chunks):
        self.calls.append("prepare")
        return super().prepare(strategy, chunks)

    def prepare_draft(self, strategy, block, noise_id):
        self.calls.append("prepare_draft")
        return super().prepare_draft(strategy, block, noise_id)

    def publish(self, prepared):
        self.calls.append("publish")

    def gather(self, prepared, logits):
        self.calls.append("gather")
        return super().gather(prepared, logits)

    def gather_draft(self, prepared, hidden, base):
        self.calls.append("gather_draft")
        return super().gather_draft(prepared, hidden, base)


def _runner(model, transport=None):
    cfg = model.cfg
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 3, bs, model.engram_spec, extra_ring_rows=4)
    cache = allocate_cache(cfg, 3, 24, bs, torch.float32, extra_ring_rows=4)
    return ModelRunner(model, cache, layout, EagerStrategy(model, layout), transport=transport)


def test_model_runner_on_one_rank_goes_through_the_no_op_transport():
    cfg = tiny_config("v41")
    model = tiny_model(cfg)
    model.enable_drafting()
    prompt = [0] + torch.randint(3, 128000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    chunk = SeqChunk(slot=1, ctx_len=0, num_new=len(prompt), block_table=list(range(1, 24)), token_ids=prompt,
                     num_logits=2)

    plain = _runner(model)
    assert type(plain.transport) is SingleRankTransport
    out = plain.run([chunk])
    # what the strategy computes for the same step on a fresh cache: the no-op transport changes nothing
    ref = _runner(model)
    step, bucket = ref.strategy.prepare([chunk])
    assert torch.equal(out.logits, ref.strategy.forward(step, ref.cache, bucket)[:2])

    block = DraftBlock(slots=[1], last_pos=[len(prompt) - 1], first_tokens=[int(out.logits[-1].argmax())], block=3)
    noise = int(cfg.dspark_noise_token_id)
    hidden, base = plain.draft(block, noise)
    want_hidden, want_base = model.draft(draft_step_inputs(block, ref.layout, noise), ref.cache)
    assert torch.equal(hidden, want_hidden) and torch.equal(base, want_base)

    recording = RecordingTransport()
    runner = _runner(model, recording)
    assert torch.equal(runner.run([chunk]).logits, out.logits)
    assert recording.calls == ["prepare", "publish", "gather"]
    got_hidden, got_base = runner.draft(block, noise)
    assert recording.calls[3:] == ["prepare_draft", "publish", "gather_draft"]
    assert torch.equal(got_hidden, hidden) and torch.equal(got_base, base)


def test_plain_and_speculative_steps_return_one_result_type(tiny_v41_dir):
    assert inspect.signature(Worker.execute).return_annotation in (StepResult, "StepResult")
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    prompt = [0, 5, 6, 7, 8]
    for drafts in (0, 2):
        ec = EngineConfig(model=str(tiny_v41_dir), dtype="float32", max_model_len=64, max_num_seqs=2,
                          num_speculative_tokens=drafts).resolve(cfg)
        model = build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False)
        worker = Worker(cfg, ec, model=model)
        engine = LLMEngine(ec, model_config=cfg, worker=worker)
        steps = []
        execute = worker.execute

        def recording(scheduled, execute=execute, steps=steps):
            result = execute(scheduled)
            steps.append(([s.do_sample for s in scheduled], [len(s.draft_token_ids) for s in scheduled], result))
            return result
        worker.execute = recording
        engine.add_request("a", list(prompt), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        engine.add_request("b", list(prompt[:3]), SamplingParams(temperature=0.9, seed=4, max_tokens=6,
                                                                  ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert len(steps) >= 3
        for do_sample, verified, result in steps:
            assert type(result) is StepResult
            assert len(result.rows) == sum(do_sample)
            sampled = [n for n, d in zip(verified, do_sample) if d]
            assert [row.num_drafts for row in result.rows] == sampled
            for row in result.rows:
                assert 1 <= len(row.tokens) <= 1 + row.num_drafts and row.num_accepted == len(row.tokens) - 1
        rows = [row for _, _, result in steps for row in result.rows]
        if drafts:
            assert any(row.num_drafts for row in rows)
            assert any(row.proposal is not None and len(row.proposal.token_ids) <= drafts for row in rows)
        else:
            assert all(row.proposal is None and row.num_drafts == 0 and len(row.tokens) == 1 for row in rows)
        engine.close()

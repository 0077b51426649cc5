"""Speculative runs on the tiny V4.1 checkpoint, shared by the speculative tests: an LLM over a loaded
model, seeded prompts of given lengths, the generated ids, and oracle drafts (the plain run's
continuation, some depths corrupted) in place of the model's own proposals."""
import random

import torch

from deepinfer import LLM
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.spec import proposer
from deepinfer.worker.worker import Worker, build_model


def spec_llm(v41, **kw):
    """An LLM over v41 = (checkpoint dir, its ModelConfig, the loaded model), in fp32."""
    d, cfg, model = v41
    ec = EngineConfig(model=str(d), dtype="float32", **kw).resolve(cfg)
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=Worker(cfg, ec, model=model)))


def platform_llm(d, cfg, platform, worker_kw=None, **kw):
    """An fp32 LLM of 2 sequences, 64 tokens, 32-token steps over checkpoint d built for `platform`
    (worker_kw: e.g. the Neuron strategy's buckets)."""
    model = build_model(cfg, str(d), torch.float32, progress=False, platform=platform,
                        draft_vocab=kw.get("speculative_draft_vocab"))
    ec = EngineConfig(model=str(d), dtype="float32", max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=32, **kw).resolve(cfg)
    worker = Worker(cfg, ec, model=model, platform=platform, **(worker_kw or {}))
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))


def prompts_of_lengths(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": [0] + torch.randint(3, 128000, (m - 1,), generator=g).tolist()} for m in lens]


def token_lists(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def oracle_drafts(monkeypatch, prompts, continuations, corrupt=0.3):
    """Replace each real proposal by the plain run's next tokens, each depth corrupted with
    probability `corrupt` (a fixed draw per sequence, position and depth), so accepted runs and
    rejections at every depth both happen."""
    truth = {tuple(p["prompt_token_ids"]): c for p, c in zip(prompts, continuations)}
    real, taken = proposer.DraftProposer.propose, proposer.DraftProposer.take_drafts

    def draft(self, scheduled, results):
        real(self, scheduled, results)
        overwrite(scheduled, results)

    def take(self, scheduled, results, drafted):   # drafts made on the device with the step
        taken(self, scheduled, results, drafted)
        overwrite(scheduled, results)

    def overwrite(scheduled, results):
        for i, s in enumerate(scheduled):
            prop = results.get(i) and results[i].proposal
            if not prop:
                continue
            done = s.seq.num_output_tokens + len(results[i].tokens)
            cont = truth[tuple(s.seq.prompt_token_ids)]
            ids = []
            for j in range(len(prop.token_ids)):
                t = cont[done + j] if done + j < len(cont) else 5
                bad = random.Random(s.seq.prompt_len * 100003 + (done + j) * 17 + j).random() < corrupt
                ids.append((t + 1) % 128000 if bad else t)
            prop.token_ids = ids
    monkeypatch.setattr(proposer.DraftProposer, "propose", draft)
    monkeypatch.setattr(proposer.DraftProposer, "take_drafts", take)


def record_proposals(monkeypatch) -> list:
    """Every proposal the proposer makes, drafted on the host (`propose`) or with the step on the device
    (`take_drafts`), in step and row order: (prompt length, outputs before it, draft ids, confidences)."""
    seen = []
    real_propose, real_take = proposer.DraftProposer.propose, proposer.DraftProposer.take_drafts

    def note(scheduled, results):
        for i, s in enumerate(scheduled):
            prop = results.get(i) and results[i].proposal
            if prop:
                seen.append((s.seq.prompt_len, s.seq.num_output_tokens + len(results[i].tokens),
                             list(prop.token_ids), list(prop.confidences)))

    def propose(self, scheduled, results):
        real_propose(self, scheduled, results)
        note(scheduled, results)

    def take(self, scheduled, results, drafted):
        real_take(self, scheduled, results, drafted)
        note(scheduled, results)
    monkeypatch.setattr(proposer.DraftProposer, "propose", propose)
    monkeypatch.setattr(proposer.DraftProposer, "take_drafts", take)
    return seen

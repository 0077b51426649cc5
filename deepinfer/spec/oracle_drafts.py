"""Oracle drafts: every proposal is the continuation a plain greedy run produced, so every draft is
accepted and a speculative step costs only its verification (the main forward over 1 + n rows a
sequence, plus verify.py), never a draft forward. For measuring the engine's cost of speculative
decoding without a trained draft (examples/bench/bench_offline.py --oracle-drafts); the tokens equal
the plain run's, which the bench checks."""
from __future__ import annotations

import contextlib

from deepinfer.spec.proposer import DraftProposer
from deepinfer.step_result import DraftProposal

# proposals past a continuation's end (never accepted there: max_tokens stops the row first)
FILLER_TOKEN = 5


class OracleProposer(DraftProposer):
    # the step never drafts on the device (spec/greedy_step.py): those drafts would be the model's own,
    # and the block's forward is the cost an oracle leaves out
    drafts_on_device = False

    def __init__(self, proposer: DraftProposer, continuations: dict[tuple[int, ...], list[int]]):
        """proposer: the engine's own (its limits are kept); continuations: prompt ids -> plain output ids."""
        super().__init__(proposer.runner, proposer.num_drafts, proposer.max_model_len, proposer.eos_ids,
                         proposer.noise_id)
        self.continuations = continuations

    def propose(self, scheduled, results) -> None:
        for i, n, _ in self.draft_rows(scheduled, results):
            seq = scheduled[i].seq
            if not seq.sampling_params.is_greedy:
                raise ValueError("oracle drafts are for greedy requests (a sampled row needs the draft distribution)")
            cont = self.continuations[tuple(seq.prompt_token_ids)]
            done = seq.num_output_tokens + len(results[i].tokens)
            ids = [cont[k] if k < len(cont) else FILLER_TOKEN for k in range(done, done + n)]
            results[i].proposal = DraftProposal(ids, None, [1.0] * n)


@contextlib.contextmanager
def oracle_drafts(llm, continuations: dict[tuple[int, ...], list[int]]):
    """Within the block, a speculative LLM (entrypoints/llm.py, one rank) proposes from `continuations`."""
    spec = getattr(llm.llm_engine.worker, "spec", None)
    if spec is None:
        raise ValueError("oracle drafts need an engine with num_speculative_tokens > 0")
    own = spec.proposer
    spec.proposer = OracleProposer(own, continuations)
    try:
        yield
    finally:
        spec.proposer = own

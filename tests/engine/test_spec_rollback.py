"""Rolling back rejected drafts (docs/model.md §5.3): after a verification row whose last drafts were
rejected, the next step's logits and the next draft block equal those of a run that never fed the
rejected tokens; without the extra ring rows (the negative control) they do not."""
import torch

from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.models import dspark_draft
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size, speculative_ring_rows
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.runners import EagerStrategy
from tests.support.model_helpers import tiny_config, tiny_model

B = 3


def _runner(model, extra_rows):
    cfg = model.cfg
    bs = default_block_size(cfg)
    layout = cache_layout(cfg, 3, bs, model.engram_spec, extra_ring_rows=extra_rows)
    cache = allocate_cache(cfg, 3, 24, bs, torch.float32, extra_ring_rows=extra_rows)
    return ModelRunner(model, cache, layout, EagerStrategy(model, layout))


def _logits(runner, tokens, ctx, n, logits=1):
    chunk = SeqChunk(slot=1, ctx_len=ctx, num_new=n, block_table=list(range(1, 24)), token_ids=tokens,
                     num_logits=logits)
    return runner.run([chunk]).logits


def _draft(runner, model, last_pos, x0):
    block = dspark_draft.DraftBlock(slots=[1], last_pos=[last_pos], first_tokens=[x0], block=B)
    step = dspark_draft.draft_step_inputs(block, runner.layout, model.cfg.dspark_noise_token_id)
    return model.draft(step, runner.cache)


def _runs(model, extra_rows):
    """(speculated, plain) final-step logits and draft-block logits for the same committed history."""
    g = torch.Generator().manual_seed(5)
    # odd prompt length: the next step's ratio-2 group starts inside the verified run, so its first
    # row comes from the compressor state ring the rejected tokens wrote over
    prompt = [0] + torch.randint(3, 128000, (28,), generator=g).tolist()
    n = len(prompt)

    plain = _runner(model, extra_rows)
    x0 = int(_logits(plain, prompt, 0, n).argmax())
    d0 = int(_logits(plain, prompt + [x0], n, 1).argmax())
    y = int(_logits(plain, prompt + [x0, d0], n + 1, 1).argmax())
    want = _logits(plain, prompt + [x0, d0, y], n + 2, 1)
    want_draft = _draft(plain, model, n + 2, int(want.argmax()))

    spec = _runner(model, extra_rows)
    assert int(_logits(spec, prompt, 0, n).argmax()) == x0
    wrong = [(y + 1) % 128000, (y + 7) % 128000]
    rows = _logits(spec, prompt + [x0, d0] + wrong, n, 1 + B, logits=1 + B)  # verify [x0, d0, w1, w2]
    assert rows.shape[0] == 1 + B
    assert int(rows[0].argmax()) == d0 and int(rows[1].argmax()) == y  # d0 accepted, w1 rejected
    got = _logits(spec, prompt + [x0, d0, y], n + 2, 1)  # committed n + 2, the rejected ones dropped
    got_draft = _draft(spec, model, n + 2, int(got.argmax()))
    return (got, want), (got_draft[1], want_draft[1])


def test_next_step_after_rejection_equals_a_run_that_never_saw_it():
    cfg = tiny_config("v41")
    model = tiny_model(cfg)
    model.enable_drafting()
    (got, want), (got_d, want_d) = _runs(model, speculative_ring_rows(B))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_d, want_d, rtol=1e-4, atol=1e-4)

    # Negative control: rings of exactly the window / ratio, as without speculation.
    (got, want), (got_d, want_d) = _runs(model, 0)
    assert (got - want).abs().max() > 1e-2
    assert (got_d - want_d).abs().max() > 1e-2

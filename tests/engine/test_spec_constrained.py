"""Speculative decoding for requests with logprobs and with a grammar (spec/decoder.py), end to end on
the tiny V4.1 checkpoint.

Logprobs rows draft, and every emitted token carries the entries the plain sampler gives there: greedy
rows match a run without drafts token for token and entry for entry; sampled rows (whose tokens differ
from a run without drafts) match the prompt-logprob scores of their own output. Grammar rows draft under
the grammar's per-depth masks: greedy rows give the text of a run without drafts, all outputs are valid, also
across preemption, and after every step each matcher is exactly the one that replaying the sequence's
outputs gives (nothing of a rejected draft leaks). Below the engine: GrammarState.masks_along, and
spec_verify.verify's per-depth masks and logprob entries."""
import copy
import json

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.sampling_params import GREEDY_TEMPERATURE, StructuredOutputsParams
from deepinfer.worker.worker import build_model

from tests.support.spec_runs import oracle_drafts, prompts_of_lengths, spec_llm, token_lists

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
          "required": ["answer", "ok"], "additionalProperties": False}
JSON = StructuredOutputsParams(json=SCHEMA)
REGEX = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")


@pytest.fixture(scope="module")
def v41(tiny_v41_dir):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    return tiny_v41_dir, cfg, build_model(cfg, str(tiny_v41_dir), torch.float32, progress=False)


def _same_entries(got, want, temperature: float, deep_rank: int = 2) -> None:
    """Two outputs' logprob lists agree: the same ids per position, logprobs within float noise, and the
    same ranks except deep in the distribution (a batch of another shape moves the last bits).

    Logprobs are of the processed distribution, (logit - logsumexp) / T, so logit noise grows by 1 / T:
    greedy rows (T = 1e-5) are compared in logit units."""
    t_eff = max(temperature, GREEDY_TEMPERATURE)
    assert len(got) == len(want)
    for pos, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), pos
        for t in w:
            assert abs(g[t].logprob - w[t].logprob) * t_eff < 1e-4, (pos, t, g[t], w[t])
            assert g[t].rank == w[t].rank or w[t].rank > deep_rank, (pos, t, g[t], w[t])


def test_greedy_logprobs_rows_draft_and_report_the_plain_entries(v41, monkeypatch):
    prompts = prompts_of_lengths((5, 19, 33), seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)]
    ref = spec_llm(v41, max_model_len=96, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    real = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    runs = [real.generate(prompts, params, use_tqdm=False)]
    oracle_drafts(monkeypatch, prompts, token_lists(ref))
    oracle = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    runs.append(oracle.generate(prompts, params, use_tqdm=False))
    for outs in runs:
        assert token_lists(outs) == token_lists(ref)
        for o, r in zip(outs, ref):
            assert (o.outputs[0].logprobs is None) == (r.outputs[0].logprobs is None)
            if r.outputs[0].logprobs is not None:
                _same_entries(o.outputs[0].logprobs, r.outputs[0].logprobs, 0.0)
        assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    assert runs[1][0].metrics.num_accepted_tokens > 0 and runs[1][2].metrics.num_accepted_tokens > 0
    assert [len(e) for e in runs[1][0].outputs[0].logprobs] == [3] * 12  # the top 3 (the greedy token is first)


def test_sampled_logprobs_rows_report_the_entries_of_their_own_tokens(v41, monkeypatch):
    """At T = 1 without filters the processed distribution is the raw one, so each emitted token's entry
    (accepted draft, residual draw or bonus) must equal the prompt-logprob score of that output token."""
    prompts = prompts_of_lengths((7, 21), seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    continuations = token_lists(spec_llm(v41, max_model_len=96).generate(prompts, greedy, use_tqdm=False))
    oracle_drafts(monkeypatch, prompts, continuations, corrupt=0.2)
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True, logprobs=2)
              for i in range(2)]
    llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    monkeypatch.undo()
    plain = spec_llm(v41, max_model_len=96, max_num_seqs=4)
    for p, o in zip(prompts, outs):
        ids = list(p["prompt_token_ids"])
        scored = plain.generate([{"prompt_token_ids": ids + list(o.outputs[0].token_ids)}],
                                SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
        _same_entries(o.outputs[0].logprobs, scored[0].prompt_logprobs[len(ids):], 1.0)


def _check_matchers(eng) -> int:
    """Every live grammar sequence's matcher is the one replaying its outputs gives; returns how many."""
    checked = 0
    for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        if seq.grammar is None:
            continue
        compiler = eng._grammar_compiler
        fresh = compiler.new_state(compiler.compile(seq.sampling_params.structured_outputs))
        fresh.rebuild(seq.output_token_ids)
        live = seq.grammar.bitmask.clone()
        seq.grammar.matcher.fill_next_token_bitmask(live.unsqueeze(0))
        assert torch.equal(live, fresh.bitmask) and torch.equal(seq.grammar.bitmask, fresh.bitmask), seq.seq_id
        assert seq.grammar.matcher.is_terminated() == fresh.matcher.is_terminated()
        checked += 1
    return checked


def _generate_checking(llm, prompts, params):
    """llm.generate, checking every grammar matcher after each step; outputs in request order."""
    eng = llm.llm_engine
    for i, (p, q) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, q)
    done, checks = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        checks += _check_matchers(eng)
    assert checks > 0
    return [done[str(i)] for i in range(len(prompts))]


def _valid(so: StructuredOutputsParams, text: str) -> bool:
    if so is JSON:
        value = json.loads(text)
        return set(value) == {"answer", "ok"} and value["answer"] in ("yes", "no")
    head, _, tail = text.partition("-")
    return len(head) == 3 and head.isdigit() and 2 <= len(tail) <= 4 and tail.isalpha()


GRAMMAR_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=JSON),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),                  # a plain row
    SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=REGEX, logprobs=1),
    SamplingParams(temperature=0.9, seed=4, max_tokens=30, structured_outputs=JSON, min_tokens=3),
]


def test_grammar_rows_draft_and_keep_the_text_and_the_matcher(v41, monkeypatch):
    """A mixed batch (greedy and sampled grammar rows, a plain row, a grammar row with logprobs) with the
    checkpoint's drafts, then with oracle drafts (right, or breaking the grammar) in a pool that preempts."""
    prompts = prompts_of_lengths((6, 17, 29, 12), seed=5)
    ref = spec_llm(v41, max_model_len=96, max_num_seqs=4).generate(prompts, GRAMMAR_PARAMS, use_tqdm=False)
    greedy_rows = [0, 1, 2]
    runs = {"real": _generate_checking(spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3),
                                       prompts, GRAMMAR_PARAMS)}
    oracle_drafts(monkeypatch, prompts, token_lists(ref))
    tight = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3, num_kv_blocks=7, block_size=16)
    runs["oracle, preempted"] = _generate_checking(tight, prompts, GRAMMAR_PARAMS)
    st = tight.llm_engine.stats()
    assert st.num_preemptions > 0 and st.num_used_blocks == 0 and st.num_used_state_slots == 0
    for name, outs in runs.items():
        got = token_lists(outs)
        assert [got[i] for i in greedy_rows] == [token_lists(ref)[i] for i in greedy_rows], name
        assert [outs[i].outputs[0].text for i in greedy_rows] == [ref[i].outputs[0].text for i in greedy_rows]
        for i in (0, 2, 3):
            text = outs[i].outputs[0].text
            assert _valid(GRAMMAR_PARAMS[i].structured_outputs, text), (name, text)
            assert outs[i].metrics.num_draft_tokens > 0, (name, i)
        _same_entries(outs[2].outputs[0].logprobs, ref[2].outputs[0].logprobs, 0.0)
    # The checkpoint's drafts are random, but drafted under the grammar's masks they hit its forced tokens.
    assert runs["real"][0].metrics.num_accepted_tokens > 0 and runs["real"][3].metrics.num_accepted_tokens > 0
    # Oracle drafts are right most of the time: grammar rows accept runs of them.
    oracle = runs["oracle, preempted"]
    assert oracle[0].metrics.num_accepted_tokens > 0 and oracle[2].metrics.num_accepted_tokens > 0


def test_masks_along_walks_the_matcher_ahead_and_puts_it_back(tiny_v41_dir):
    from transformers import AutoTokenizer

    from deepinfer.structured_output import GrammarCompiler
    tok = AutoTokenizer.from_pretrained(str(tiny_v41_dir))
    compiler = GrammarCompiler(tok, 129280, [1])
    state = compiler.new_state(compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}-?[a-z]{0,2}")))
    digits, letters = tok.encode("123", add_special_tokens=False), tok.encode("-ab", add_special_tokens=False)
    path = digits + letters + [1]
    before = state.bitmask.clone()

    def allowed(mask, t):
        return bool((int(mask[t // 32]) >> (t % 32)) & 1)

    masks = state.masks_along(path, lambda j: ())
    assert len(masks) == len(path) + 1 and masks[-1] is None  # nothing follows EOS: the grammar is complete
    assert torch.equal(masks[0], before)
    assert all(allowed(masks[j], t) for j, t in enumerate(path))
    later = state.masks_along(path, lambda j: (), first=2)  # only the masks from depth 2 on
    assert len(later) == len(path) - 1 and later[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(later[:-1], masks[2:-1]))
    # A token the grammar rejects ends the path: the depths after it get no mask.
    bad = state.masks_along(letters + digits, lambda j: ())
    assert bad[0] is not None and all(m is None for m in bad[1:])
    # Only EOS may follow "123-ab", and it is banned there (min_tokens): a dead end, no mask.
    dead = state.masks_along(path[:-1], lambda j: (1,) if j == len(path) - 1 else ())
    assert dead[-1] is None and all(m is not None for m in dead[:-1])
    # The matcher is where it was: same mask, and it still accepts the path from the start.
    state.matcher.fill_next_token_bitmask(state.bitmask.unsqueeze(0))
    assert torch.equal(state.bitmask, before) and not state.matcher.is_terminated()
    assert all(state.advance(t) is None for t in path[:-1]) and state.advance(1) == "grammar_complete"


def test_verify_reports_logprob_entries_and_applies_each_depths_mask():
    """spec_verify.verify on its own: with logprobs asked, each emitted token's logprob, rank and top-k are
    those of the processed distribution of its depth; with a bitmask per depth (a grammar's masks along
    the drafts) no token outside that depth's mask is accepted or emitted."""
    from deepinfer.model_executor.layers.sampler import Sampler
    from deepinfer.spec.verify import VerifyBatch, verify

    from tests.support.verify_cases import mixed_case
    params, logits, drafts, draft_lp = mixed_case(r=30, b=3, vocab=40, seed=6)
    params = [copy.copy(p) for p in params]
    for i, p in enumerate(params):
        p.logprobs = 3 if i % 2 else None  # the batch's top-k is the widest request's
    r, b = drafts.shape
    g = torch.Generator().manual_seed(7)
    allowed = torch.rand(r * (b + 1), 40, generator=g) < 0.5
    allowed[:, 0] = True  # never empty
    bits = (allowed.to(torch.int64) << torch.arange(40) % 32)
    words = torch.stack([bits[:, :32].sum(1), bits[:, 32:].sum(1)], 1)
    masks = list(((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32))  # as signed int32 words
    seeds, positions = [50 + i for i in range(r)], [4 + i % 3 for i in range(r)]
    batch = VerifyBatch.build(params, positions, b, seeds=seeds, bitmask_per_row=masks)
    out = verify(logits, drafts, draft_lp, batch)
    lp = Sampler().processed_logprobs(logits.reshape(r * (b + 1), -1), batch.sampling).reshape(r, b + 1, -1)
    assert out.top_ids.shape == (r, b + 1, 3)
    for i in range(r):
        for j in range(int(out.num_accepted[i]) + 1):
            t = int(out.token_ids[i, j])
            assert allowed[i * (b + 1) + j, t], (i, j, t)
            assert torch.isclose(out.logprobs[i, j], lp[i, j, t])
            assert int(out.token_ranks[i, j]) == 1 + int((lp[i, j] > lp[i, j, t]).sum())
            top = torch.topk(lp[i, j], 3)
            assert out.top_ids[i, j].tolist() == top.indices.tolist()
            assert torch.allclose(out.top_logprobs[i, j], top.values)
    assert int(out.num_accepted.sum()) > 0  # some drafts inside the masks were accepted

"""Speculative decoding with a draft vocabulary (model_executor/models/draft_vocab.py) end to end on the
tiny V4.1 checkpoint: drafts only ever take the vocabulary's tokens; one that holds every token the
whole-vocabulary drafts took gives exactly those drafts (so the draft heads' row selection is right);
one that holds none of them gives other drafts; greedy tokens equal plain greedy either way; sampled
requests stay reproducible per seed; bad settings are refused."""
import json
import random

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine_config import EngineConfig
from deepinfer.worker.worker import build_model

from tests.support.spec_runs import prompts_of_lengths, record_proposals, spec_llm, token_lists

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = prompts_of_lengths((5, 17, 30), seed=7)


def _model(d, draft_vocab=None):
    cfg = ModelConfig.from_pretrained(d)
    return d, cfg, build_model(cfg, str(d), torch.float32, progress=False, draft_vocab=draft_vocab)


def _vocab_file(tmp_path, ids, name="vocab.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps({"token_ids": sorted(ids)}))
    return str(p)


@pytest.fixture(scope="module")
def reference(tiny_v41_dir):
    """(plain greedy tokens, the whole-vocabulary speculative run's tokens and drafts)."""
    v41 = _model(tiny_v41_dir)
    plain = token_lists(spec_llm(v41, max_model_len=96, max_num_seqs=4).generate(PROMPTS, GREEDY, use_tqdm=False))
    mp = pytest.MonkeyPatch()
    try:
        seen = record_proposals(mp)
        llm = spec_llm(v41, max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
        tokens = token_lists(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        mp.undo()
    drafts = [ids for _, _, ids, _ in seen]
    assert drafts and tokens == plain
    return plain, tokens, drafts


def _spec_run(d, vocab, monkeypatch, params=GREEDY, prompts=PROMPTS, **kw):
    seen = record_proposals(monkeypatch)
    llm = spec_llm(_model(d, vocab), max_model_len=96, max_num_seqs=4, num_speculative_tokens=3, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.llm_engine.stats()
    assert st.num_used_blocks == 0 and st.num_used_state_slots == 0
    return token_lists(outs), [ids for _, _, ids, _ in seen]


def test_a_vocabulary_holding_every_draft_gives_the_same_drafts(tiny_v41_dir, tmp_path, reference, monkeypatch):
    plain, _, want = reference
    taken = {t for d in want for t in d}
    extra = random.Random(0).sample(range(128000), 300)
    tokens, drafts = _spec_run(tiny_v41_dir, _vocab_file(tmp_path, taken | set(extra)), monkeypatch)
    assert tokens == plain
    assert drafts == want


def test_a_vocabulary_without_those_drafts_drafts_only_its_own_tokens(tiny_v41_dir, tmp_path, reference,
                                                                     monkeypatch):
    plain, _, want = reference
    taken = {t for d in want for t in d}
    vocab = [t for t in random.Random(1).sample(range(128000), 400) if t not in taken]
    tokens, drafts = _spec_run(tiny_v41_dir, _vocab_file(tmp_path, vocab), monkeypatch)
    assert tokens == plain                                      # verification keeps the whole vocabulary
    flat = [t for d in drafts for t in d]
    assert flat and set(flat) <= set(vocab) and not set(flat) & taken


def test_sampled_drafts_stay_in_the_vocabulary_and_reproduce_per_seed(tiny_v41_dir, tmp_path, monkeypatch):
    vocab = random.Random(2).sample(range(128000), 500)
    path = _vocab_file(tmp_path, vocab)
    params = [SamplingParams(temperature=0.8, top_k=40, seed=21 + i, max_tokens=10, ignore_eos=True)
              for i in range(3)]
    together, drafts = _spec_run(tiny_v41_dir, path, monkeypatch, params=params)
    flat = [t for d in drafts for t in d]
    assert flat and set(flat) <= set(vocab)
    alone = [_spec_run(tiny_v41_dir, path, monkeypatch, params=q, prompts=[p])[0][0] for p, q in zip(PROMPTS, params)]
    assert together == alone and all(len(t) == 10 for t in together)


def test_bad_settings_are_refused(tiny_v41_dir, tmp_path):
    path = _vocab_file(tmp_path, [1, 2, 3])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model=str(tiny_v41_dir), speculative_draft_vocab=path)
    with pytest.raises(ValueError, match="speculative_draft_vocab"):
        EngineConfig(model=str(tiny_v41_dir), num_speculative_tokens=2, speculative_draft_vocab="")
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, "):
        _model(tiny_v41_dir, _vocab_file(tmp_path, [1, 10 ** 7], "big.json"))


def test_grammar_rows_whose_tokens_lie_outside_the_vocabulary_draft_nothing(tiny_v41_dir, tmp_path, monkeypatch):
    """A regex whose every token lies outside the draft vocabulary leaves a grammar row's draft logits all
    masked: greedy and sampled rows then stop drafting (no out-of-vocabulary draw), and their tokens are
    the plain run's, valid for the regex."""
    from deepinfer.sampling_params import StructuredOutputsParams
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")
    d = tiny_v41_dir
    tok = _tokenizer(d)
    allowed = {i for i in range(tok.get_vocab_size())
               if (t := tok.decode([i])) and all(ch.isdigit() or ch == "-" or "a" <= ch <= "z" for ch in t)}
    vocab = [t for t in random.Random(3).sample(range(128000), 400) if t not in allowed]
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=regex),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12, structured_outputs=regex)]
    prompts = PROMPTS[:2]
    plain = spec_llm(_model(d), max_model_len=96, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    seen = record_proposals(monkeypatch)
    llm = spec_llm(_model(d, _vocab_file(tmp_path, vocab)), max_model_len=96, max_num_seqs=4, num_speculative_tokens=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_lists(outs)[0] == token_lists(plain)[0]
    for o in outs:
        head, _, tail = o.outputs[0].text.partition("-")
        assert len(head) == 3 and head.isdigit() and 2 <= len(tail) <= 4 and tail.isalpha(), o.outputs[0].text
        assert o.metrics.num_draft_tokens == 0
    assert not [t for _, _, ids, _ in seen for t in ids]


def _tokenizer(d):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(d / "tokenizer.json"))

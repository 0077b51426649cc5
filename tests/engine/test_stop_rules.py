"""deepinfer.stop_rules: the one place that decides a request stops (EOS, stop_token_ids, stop
strings, min_tokens, max_tokens, max_model_len), and the sampler ban that mirrors it."""

from __future__ import annotations

import re

import pytest

from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import Sequence
from deepinfer.stop_rules import apply_stop_rules, banned_token_ids

from tests.support import REPO
from tests.support.toy_engine import EOS, ToyWorker, make_engine, run_all, text_engine



def _seq(params, prompt=(5, 6, 7)):
    return Sequence(request_id="r", seq_id=0, prompt_token_ids=list(prompt), sampling_params=params, seed=0)


def _feed(seq, tokens, max_model_len=64):
    """Append tokens one by one through the stop rules; the index of the token that finished it."""
    for i, t in enumerate(tokens):
        seq.append_token(t, -0.5)
        apply_stop_rules(seq, frozenset([EOS]), max_model_len)
        if seq.is_finished:
            return i
    return None


@pytest.mark.parametrize("params, tokens, at, reason, stop_reason", [
    (SamplingParams(max_tokens=10), [4, 9, EOS, 4], 2, "stop", None),  # EOS kept, stop_reason None
    (SamplingParams(max_tokens=10, ignore_eos=True), [4, EOS, 9, 9], 3, None, None),
    (SamplingParams(max_tokens=10, stop_token_ids=[9]), [4, 9, 4], 1, "stop", 9),
    (SamplingParams(max_tokens=10, min_tokens=3), [EOS, EOS, 4, EOS], 3, "stop", None),
    (SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]), [9, 9], 1, "stop", 9),
    (SamplingParams(max_tokens=3, min_tokens=3), [4, 4, 4, 4], 2, "length", None),
    (SamplingParams(max_tokens=None), [4] * 10, 4, "length", None),  # 3 prompt + 5 = max_model_len 8
])
def test_apply_stop_rules(params, tokens, at, reason, stop_reason):
    seq = _seq(params)
    got = _feed(seq, tokens, max_model_len=8 if params.max_tokens is None else 64)
    if reason is None:
        assert got is None and not seq.is_finished
        return
    assert got == at and seq.finish_reason == reason and seq.stop_reason == stop_reason
    assert seq.output_token_ids == tokens[:at + 1]  # the stopping token stays in the output


def test_ban_and_stop_agree_on_min_tokens():
    """The sampler can only produce an EOS / stop id that apply_stop_rules would stop on: every
    id the stop rules would pass over as the next token is banned, and the ban lifts once
    min_tokens outputs exist. (A stop string may already end the min_tokens-th token.)"""
    params = SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=[9])
    seq = _seq(params)
    for _ in range(6):
        banned = set(banned_token_ids(seq, [EOS]))
        assert banned == ({EOS, 9} if seq.num_output_tokens < params.min_tokens else set())
        for stop_id in (EOS, 9):
            probe = _seq(params)  # seq's history, then stop_id as the next token
            for t in seq.output_token_ids:
                probe.append_token(t)
            stops = _feed(probe, [stop_id]) == 0
            assert stops or stop_id in banned
        _feed(seq, [4])
    assert banned_token_ids(_seq(SamplingParams(min_tokens=2, ignore_eos=True)), [EOS]) == []


def test_engine_defers_eos_until_min_tokens():
    """A model that emits EOS early (the toy one does with avoid_eos off): before min_tokens the
    token is kept and generation goes on; the first EOS after it ends the request."""
    engine = make_engine(ToyWorker(avoid_eos=False), max_model_len=200)
    for i in range(40):
        engine.add_request(str(i), [5, 6, 7], SamplingParams(seed=i, max_tokens=150))
    free = {rid: out.outputs[0].token_ids for rid, out in run_all(engine).items()}
    early = {rid: ids for rid, ids in free.items() if ids[-1] == EOS and len(ids) <= 60}
    assert early, "some toy stream should hit EOS early"
    for rid, ids in early.items():
        min_tokens = len(ids) + 1  # its first EOS is now too early
        engine.add_request(rid, [5, 6, 7], SamplingParams(seed=int(rid), max_tokens=150, min_tokens=min_tokens))
    for rid, out in run_all(engine).items():
        c = out.outputs[0]
        assert c.token_ids[:len(early[rid])] == early[rid]  # same stream, EOS kept and passed over
        assert len(c.token_ids) >= len(early[rid]) + 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[len(early[rid]):-1]


def test_stop_string_across_deltas_and_min_tokens(tokenizer):  # noqa: F811
    engine = text_engine(tokenizer)

    def stream(sp):
        engine.add_request("s", "The cat", sp)
        pieces, final = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                c = out.outputs[0]
                pieces.append(c.delta_text)
                final = c
        return pieces, final

    pieces, ref = stream(SamplingParams(seed=5, max_tokens=24))
    ref_text = ref.text
    stop = ref_text[9:20]  # spans several tokens, so it is completed across deltas
    pieces, out = stream(SamplingParams(seed=5, max_tokens=24, stop=stop))
    cut = ref_text.find(stop)
    assert "".join(pieces) == out.text == ref_text[:cut] and out.stop_reason == stop
    assert all(stop not in p for p in pieces)
    # The same string before min_tokens does not stop: the text runs on to a later match or the end.
    n_before = len(tokenizer.encode(ref_text[:cut + len(stop)], add_bos=False))
    pieces, late = stream(SamplingParams(seed=5, max_tokens=24, stop=stop, min_tokens=n_before + 1))
    assert "".join(pieces) == late.text and len(late.text) > cut
    assert late.token_ids[:len(out.token_ids)] == out.token_ids


def test_only_stop_rules_finishes_a_sequence_as_stopped_or_length():
    """No other module in the engine or the server decides a stop or a length cut-off."""
    pattern = re.compile(r"FINISHED_STOPPED|FINISHED_LENGTH|stop_token_ids\s+or|in\s+self\.eos_token_ids")
    offenders = []
    for root in ("deepinfer",):
        for path in (REPO / root).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel in ("deepinfer/stop_rules.py", "deepinfer/sequence.py"):
                continue
            if pattern.search(path.read_text()):
                offenders.append(rel)
    assert offenders == []

"""Penalties and structured outputs through the whole engine on the tiny V4 checkpoint: greedy with
penalties is the argmax of the penalised logits at every step; JSON-schema output is grammatical and
validates; a grammar row does not change its neighbours; preemption keeps the matcher state."""
import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.structured_output import GRAMMAR_DEAD_END

PROMPT = [0, 4911, 1234, 555, 4911, 88, 1234, 9000, 4911]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
          "required": ["answer", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_v4_dir):
    return LLM(model=str(tiny_v4_dir), dtype="float32", max_model_len=256, max_num_seqs=4)


def _penalised(x, p, prompt, outputs):
    x = x.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outputs):
        c = outputs.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


# The random model's top logit is ~9 with gaps under 1, and it never repeats a token: the bias
# makes a token win (and repeat) so the penalties on its history decide the later steps.
@pytest.mark.parametrize("kw", [
    dict(logit_bias={4911: 12.0}, frequency_penalty=1.5, presence_penalty=0.5),
    dict(logit_bias={4911: 12.0, 1234: 11.5}, repetition_penalty=1.25),
    dict(logit_bias={777: 9.0}, frequency_penalty=-2.0, presence_penalty=-0.5, repetition_penalty=0.8),
])
def test_greedy_with_penalties_is_argmax_of_penalised_logits_every_step(llm, kw):
    runner = llm.llm_engine.worker.runner
    steps = []
    original = runner.run

    def recording_run(chunks, samples=None, scores=None):
        out = original(chunks, samples, scores)
        steps.append(out.logits[0].clone())
        return out

    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)
    runner.run = recording_run
    try:
        got = llm.generate([{"prompt_token_ids": PROMPT}], p, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        runner.run = original
    assert len(steps) == len(got) == 12
    for i, logits in enumerate(steps):
        assert got[i] == int(_penalised(logits, p, PROMPT, list(got[:i])).argmax()), f"step {i}"
    plain = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != got  # the penalties changed the generation


def _matcher_accepts(llm, params: StructuredOutputsParams, token_ids) -> bool:
    """An independent matcher (same compiler) accepts every output token in order."""
    import xgrammar as xgr
    compiler = llm.llm_engine._grammar_compiler
    m = xgr.GrammarMatcher(compiler.compile(params))
    return all(m.accept_token(int(t)) for t in token_ids)


def test_json_schema_output_parses_and_validates(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=60, structured_outputs=so)]
    outs = llm.generate(["Answer in JSON:", "Answer in JSON please:"], params, use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    assert len(completions) == 3
    for c in completions:
        assert _matcher_accepts(llm, so, c.token_ids)
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"answer", "ok"} and value["answer"] in ("yes", "no")
        assert isinstance(value["ok"], bool)


def test_choice_regex_and_grammar_constrain_the_text(llm):
    cases = [
        (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
        (StructuredOutputsParams(grammar='root ::= "<" ("ab" | "cd")+ ">"'),
         lambda t: t.startswith("<") and t.endswith(">")),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so) for so, _ in cases]
    outs = llm.generate(["Pick one:"] * len(cases), params, use_tqdm=False)
    for (so, ok), o in zip(cases, outs):
        c = o.outputs[0]
        assert _matcher_accepts(llm, so, c.token_ids)
        if c.finish_reason == "stop":
            assert ok(c.text), (so.kind, c.text)
        else:  # ran out of tokens inside an unbounded part: still a valid prefix
            assert so.kind in ("grammar", "json_object"), (so.kind, c.text)


def test_grammar_row_does_not_change_others_and_dead_end_finishes_cleanly(llm):
    plain = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0].outputs[0].token_ids
    # choice "a" then only EOS is allowed, which min_tokens bans: no token may follow.
    dead = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3,
                          structured_outputs=StructuredOutputsParams(choice=["a"]))
    outs = llm.generate([{"prompt_token_ids": PROMPT}, "x"], [plain, dead], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    c = outs[1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("a", "stop", GRAMMAR_DEAD_END)
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_invalid_schema_is_rejected_with_the_field(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError) as e:
        llm.generate(["x"], bad, use_tqdm=False)
    assert e.value.param == "structured_outputs.json"
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_preemption_keeps_the_matcher_state(tiny_v4_dir):
    so = StructuredOutputsParams(json=SCHEMA)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": [0] + torch.randint(3, 128000, (int(m),), generator=g).tolist()}
               for m in torch.randint(20, 50, (6,), generator=g)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so,
                             frequency_penalty=0.5) for i in range(6)]
    roomy = LLM(model=str(tiny_v4_dir), dtype="float32", max_model_len=128, max_num_seqs=6)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=str(tiny_v4_dir), dtype="float32", max_model_len=128, max_num_seqs=6, num_kv_blocks=10)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        json.loads(o.outputs[0].text)

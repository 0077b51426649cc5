"""Structured outputs with xgrammar: compile a request's constraint, track each sequence's matcher.

`GrammarCompiler` builds xgrammar's tokenizer info from the model's tokenizer once (the model's
vocab size, EOS as the grammar's stop token) and compiles a `StructuredOutputsParams` into a
grammar; a bad schema / regex / grammar raises `SamplingParamsError` (the server answers 400).
JSON is compiled without free whitespace (xgrammar's any_whitespace=False: one space after ':'
and ','), so a model cannot stall inside a JSON value by emitting whitespace forever.

Each sequence owns a `GrammarState`: the matcher plus the packed bitmask of the tokens its next
sample may take. The sampler applies the bitmask to the logits (model_executor/layers/
logits_penalties.py); after a token is appended, stop_rules.py advances the matcher and
recomputes the bitmask. The state lives on the sequence, so preemption by recompute keeps it:
the recomputed sequence resumes at the same output position with the same matcher.

Speculative decoding (spec/decoder.py, spec/proposer.py) needs the masks a few tokens ahead, along tokens that
are not committed: `GrammarState.masks_along` walks the matcher along them, fills a mask after each,
and rolls the matcher back to where it was, so only the scheduler's appends ever move it.

xgrammar is imported only when a request asks for structured output.
"""

from __future__ import annotations

import json

from deepinfer.sampling_params import SamplingParamsError, StructuredOutputsParams

# stop_reason of a sequence that structured output finished (finish_reason "stop"):
GRAMMAR_COMPLETE = "grammar_complete"  # the grammar accepted its end (no token may follow)
GRAMMAR_DEAD_END = "grammar_dead_end"  # no token the grammar allows may be sampled next


def _choice_grammar(choices: list[str]) -> str:
    # GBNF string literals take JSON-style escapes, so json.dumps quotes each choice exactly.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles structured-output constraints against one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        if tokenizer is None:
            raise SamplingParamsError("structured_outputs",
                                      "structured outputs need a tokenizer (skip_tokenizer_init is set)")
        import xgrammar as xgr

        hf = getattr(tokenizer, "hf", tokenizer)
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(_choice_grammar(list(params.choice)))
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(params.structural_tag)
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar reports bad input as RuntimeError with its C++ location first.
            reason = str(e).strip().splitlines()[0]
            reason = reason.split(": ", 1)[-1] if reason.startswith("[") else reason
            raise SamplingParamsError(f"structured_outputs.{kind}",
                                      f"invalid structured_outputs.{kind}: {reason}") from None

    def new_state(self, compiled) -> "GrammarState":
        return GrammarState(compiled, self.vocab_size)


class GrammarState:
    """One sequence's matcher and the bitmask of its next sample (int32 [ceil(V / 32)], host)."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)[0]
        self.vocab_size = vocab_size
        self.refresh(())

    def advance(self, token_id: int) -> str | None:
        """Accept a sampled token; returns the stop_reason when the grammar ends the sequence."""
        if not self.matcher.accept_token(int(token_id)):
            return GRAMMAR_DEAD_END  # only without the mask (it never lets such a token through)
        if self.matcher.is_terminated():
            return GRAMMAR_COMPLETE
        return None

    def refresh(self, banned_ids) -> bool:
        """Compute the next bitmask; False when no token outside `banned_ids` is allowed."""
        self.matcher.fill_next_token_bitmask(self.bitmask.unsqueeze(0))
        return _allows_any(self.bitmask, banned_ids, self.vocab_size)

    def masks_along(self, token_ids, banned_ids_at, first: int = 0) -> list:
        """The bitmask of the next token after each prefix token_ids[:j], j = first .. len(token_ids)
        (a lookahead: the matcher accepts the tokens, then rolls back; its state is unchanged).

        An entry is None where that prefix cannot go on: a token of it the grammar rejects, the grammar
        complete after it, or no token outside banned_ids_at(j) allowed (stop_rules would finish the
        sequence there, as `refresh` reports), and so is every later one."""
        import xgrammar as xgr

        masks, accepted = [], 0
        try:
            for j in range(len(token_ids) + 1):
                if j >= first:
                    mask = xgr.allocate_token_bitmask(1, self.vocab_size)[0]
                    self.matcher.fill_next_token_bitmask(mask.unsqueeze(0))
                    if not _allows_any(mask, banned_ids_at(j), self.vocab_size):
                        break
                    masks.append(mask)
                if j == len(token_ids) or not self.matcher.accept_token(int(token_ids[j])):
                    break
                accepted += 1
                if self.matcher.is_terminated():
                    break
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return masks + [None] * (len(token_ids) + 1 - max(first, 0) - len(masks))

    def rebuild(self, output_token_ids) -> None:
        """Reset the matcher and replay `output_token_ids` (for a sequence that lost its state)."""
        self.matcher.reset()
        for t in output_token_ids:
            self.matcher.accept_token(int(t))
        self.refresh(())


def _allows_any(bitmask, banned_ids, vocab_size: int) -> bool:
    """Some token outside `banned_ids` is set in `bitmask` (int32 words)."""
    words = bitmask.tolist()
    for t in banned_ids:
        t = int(t)
        if 0 <= t < vocab_size:
            # Python ints: mask to the word's 32 bits so a set sign bit cannot linger.
            words[t // 32] = (words[t // 32] & 0xFFFFFFFF) & ~(1 << (t % 32))
    return any(words)

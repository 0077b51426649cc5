"""When a request may stop and what it must not sample yet: the one owner of stop / EOS / min_tokens.

Both halves of the rule live here so they cannot drift apart:
  - before sampling, the worker asks `banned_token_ids`: the ids that would end a sequence before
    it has min_tokens outputs (its stop_token_ids, and EOS unless ignore_eos); the speculative step
    asks the same for each draft depth (`ahead`);
  - after a token is appended, the scheduler calls `apply_stop_rules`, which detokenizes it (stop
    strings are matched on the released text) and finishes the sequence when a rule fires.

The min_tokens boundary (vLLM's): the ban covers the first min_tokens samples, so an EOS or stop
id can be output number min_tokens + 1 at the earliest, while a stop string may already be
completed by output number min_tokens. Every EOS / stop id the sampler can produce therefore
ends the request.

A grammar (structured outputs) ends a request here too: see apply_stop_rules.

Nothing else in the engine or the server decides that a request stops or trims its text.
"""

from __future__ import annotations

from deepinfer.sequence import Sequence, SequenceStatus
from deepinfer.structured_output import GRAMMAR_DEAD_END


def _min_tokens(params) -> int:
    return getattr(params, "min_tokens", 0) or 0


def banned_token_ids(seq, eos_token_ids, ahead: int = 0) -> list[int]:
    """Ids the next sample of `seq` must not take: those that would stop it before min_tokens.
    ahead: of the sample `ahead` outputs later instead, as if the tokens before it were appended
    (speculative decoding drafts and verifies several outputs in one step, spec/decoder.py)."""
    p = seq.sampling_params
    if len(seq.output_token_ids) + ahead >= _min_tokens(p):
        return []
    banned = list(getattr(p, "stop_token_ids", None) or [])
    if not getattr(p, "ignore_eos", False):
        banned += list(eos_token_ids)
    return banned


def apply_stop_rules(seq: Sequence, eos_token_ids, max_model_len: int) -> None:
    """Judge `seq`'s newest output token and finish the sequence if it ends the request.

    In order: once min_tokens outputs exist, EOS (unless ignore_eos; stop_reason None, the token
    stays in the output), a stop token id (stop_reason = that id, kept in the output), a stop
    string completed by this token (stop_reason = the string; the text is cut before it, or after
    it with include_stop_str_in_output); then, regardless of min_tokens, max_tokens and
    max_model_len (finish_reason "length"). `eos_token_ids` is any container supporting `in`.
    """
    p = seq.sampling_params
    token_id = seq.output_token_ids[-1]
    num_out = seq.num_output_tokens
    may_stop = num_out >= _min_tokens(p)
    grammar = getattr(seq, "grammar", None)
    grammar_end = grammar.advance(token_id) if grammar is not None else None
    # Every token goes through the detokenizer (EOS included), so the text stays a true decode and
    # a stop string spanning several tokens is found on the token that completes it.
    stop_str = seq.detokenize_last(check_stop_strings=may_stop)
    if may_stop:
        if not getattr(p, "ignore_eos", False) and token_id in eos_token_ids:
            seq.finish(SequenceStatus.FINISHED_STOPPED)
            return
        if token_id in (getattr(p, "stop_token_ids", None) or ()):
            seq.finish(SequenceStatus.FINISHED_STOPPED, token_id)
            return
        if stop_str is not None:
            seq.finish(SequenceStatus.FINISHED_STOPPED, stop_str)
            return
    if grammar_end is not None:
        seq.finish(SequenceStatus.FINISHED_STOPPED, grammar_end)
        return
    max_tokens = getattr(p, "max_tokens", None)
    if (max_tokens is not None and num_out >= max_tokens) or len(seq) >= max_model_len:
        seq.finish(SequenceStatus.FINISHED_LENGTH)
        return
    if grammar is not None and not grammar.refresh(banned_token_ids(seq, eos_token_ids)):
        # Nothing the grammar allows may be sampled next (e.g. only EOS, banned by min_tokens).
        seq.finish(SequenceStatus.FINISHED_STOPPED, GRAMMAR_DEAD_END)

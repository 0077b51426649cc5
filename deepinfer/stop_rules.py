"""When a request may stop and what it must not sample yet: the one owner of stop / EOS / min_tokens.

The sampler bans the ids that would end a request before it has produced min_tokens (its stop_token_ids,
and EOS unless ignore_eos); after a token is sampled the scheduler asks `check_stop` (to be moved here).
"""


def banned_token_ids(seq, eos_token_ids) -> list[int]:
    """Ids the next sample of `seq` must not take: those that would stop it before min_tokens."""
    p = seq.sampling_params
    if len(seq.output_token_ids) >= (p.min_tokens or 0):
        return []
    banned = list(p.stop_token_ids or [])
    if not p.ignore_eos:
        banned += list(eos_token_ids)
    return banned

"""The toy engine of the scheduler tests (no real model).

The toy model writes every fed token into a paged "KV cache" through the sequence's block table
and folds it into a per-slot recurrent state; a sampled token is a hash of that state, the
position and the sequence seed. So the next token depends only on the sequence's token ids and
position -- if the cache bookkeeping is right. Stale blocks, shared blocks, a state slot that is
not reset, or a wrong computed count all change the tokens or trip an assertion."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import Sequence
from deepinfer.step_result import StepResult, sampled_rows

VOCAB = 64
EOS = 1
_M = (1 << 64) - 1


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = ((h ^ (x & _M)) * 0xBF58476D1CE4E5B9) & _M
        h ^= h >> 29
    return h


@dataclass
class ToySamplerOutput:
    token_ids: list
    logprobs: list
    token_ranks: list | None = None
    top_ids: list | None = None
    top_logprobs: list | None = None


class ToyWorker:
    prefix_caching = False   # the toy cache keeps nothing across requests (the engine reads this of a worker)

    def __init__(self, num_kv_blocks=64, block_size=4, num_state_slots=17, avoid_eos=True, token_map=None):
        self.num_kv_blocks, self.block_size, self.num_state_slots = num_kv_blocks, block_size, num_state_slots
        self.token_map = token_map  # toy token i -> real token id (tests with the real tokenizer)
        self.kv = [[None] * block_size for _ in range(num_kv_blocks)]
        self.state = [None] * num_state_slots
        self.avoid_eos = avoid_eos
        self.batches = []  # per step: [(seq_id, start, num_new_tokens, do_sample)]

    def next_token(self, state: int, pos: int, seed: int) -> int:
        if self.token_map is not None:
            return self.token_map[_mix(state, pos, seed) % len(self.token_map)]
        tok = _mix(state, pos, seed) % VOCAB
        if self.avoid_eos and tok == EOS:
            tok = 2
        return tok

    def execute(self, scheduled):
        bs = self.block_size
        out = ToySamplerOutput([], [], [], [], [])
        self.batches.append([(s.seq.seq_id, s.seq.num_computed_tokens, s.num_new_tokens, s.do_sample)
                             for s in scheduled])
        slots = [s.seq.state_slot for s in scheduled]
        assert len(set(slots)) == len(slots) and 0 not in slots and None not in slots
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            assert n >= 1 and start + n <= len(seq)
            assert 0 not in seq.block_table and len(seq.block_table) * bs >= start + n
            if start == 0:
                self.state[seq.state_slot] = 0  # a fresh (or recomputed) sequence starts clean
            assert self.state[seq.state_slot] is not None
            for pos in range(start, start + n):
                tok = seq.token_ids[pos]
                self.kv[seq.block_table[pos // bs]][pos % bs] = (seq.seq_id, tok)
                self.state[seq.state_slot] = _mix(self.state[seq.state_slot], tok, pos)
            if item.do_sample:
                length = start + n
                cached = [self.kv[seq.block_table[p // bs]][p % bs] for p in range(length)]
                assert cached == [(seq.seq_id, t) for t in seq.token_ids[:length]], "paged cache corrupted"
                tok = self.next_token(self.state[seq.state_slot], length, seq.seed)
                out.token_ids.append(tok)
                out.logprobs.append(-(tok % 7) / 4)
                out.token_ranks.append(1 + tok % 3)
                out.top_ids.append([tok, (tok + 1) % VOCAB, (tok + 2) % VOCAB])
                out.top_logprobs.append([-0.1, -1.0, -2.0])
        return StepResult(sampled_rows(out))


def _model_config(max_pos=256):
    return SimpleNamespace(vocab_size=VOCAB, eos_token_ids=[EOS], max_position_embeddings=max_pos)


def make_engine(worker=None, **cfg) -> LLMEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 32)
    return LLMEngine(EngineConfig(model="toy", skip_tokenizer_init=True, **cfg), model_config=_model_config(),
                     worker=worker or ToyWorker())


def run_all(engine: LLMEngine, max_steps=10_000) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        assert steps < max_steps
    return finals


def reference_tokens(prompt, params) -> list[int]:
    """The request alone: big pool, whole prompt in one chunk."""
    engine = make_engine(ToyWorker(num_kv_blocks=256), max_num_batched_tokens=256)
    engine.add_request("solo", {"prompt_token_ids": prompt}, params)
    return run_all(engine)["solo"].outputs[0].token_ids


def assert_pool_empty(engine: LLMEngine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_used_state_slots == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def make_seq(seq_id, n_prompt, arrival=None, params=None):
    return Sequence(request_id=f"r{seq_id}", seq_id=seq_id, prompt_token_ids=[5] * n_prompt,
                    sampling_params=params or SamplingParams(max_tokens=100, ignore_eos=True),
                    seed=seq_id, arrival_time=float(seq_id if arrival is None else arrival))


def text_engine(tokenizer, words=(" the", " cat", " sat", " on", " a", " mat", ".", " dog")):
    ids = [tokenizer.encode(w, add_bos=False) for w in words]
    assert all(len(i) == 1 for i in ids)
    worker = ToyWorker(token_map=[i[0] for i in ids])
    config = EngineConfig(model="toy", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    return LLMEngine(config, tokenizer=tokenizer, worker=worker,
                     model_config=SimpleNamespace(vocab_size=129280, eos_token_ids=[1], max_position_embeddings=64))

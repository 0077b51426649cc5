"""LLMEngine: add_request / abort_request / step over one scheduler and one executor (executor/base.py:
the model on one rank or spread over several).

Not thread-safe: a server calls it from a single engine thread (aborts included). The one exception
is `watch_ranks`: its callback runs on the ranks' watchdog thread, so a server hears of a lost rank
while it waits for work, and answers with `check_ranks` on its engine thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine_config import EngineConfig
from deepinfer.outputs import CompletionOutput, ListPrefix, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.sequence import Sequence, effective_seed
from deepinfer.spec.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


def _min(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


@dataclass
class StepTiming:
    """Wall time of one engine step's phases (seconds) and its batch shape, for benchmarks (the
    ModelRunner's own phases: worker/model_runner.py RunnerTiming)."""
    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0
    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_sampled: int = 0
    num_preempted: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.update_s + self.output_s


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_used_state_slots: int
    num_free_state_slots: int
    num_prompt_tokens: int  # prompt tokens of requests whose prefill finished (once per request)
    num_generation_tokens: int  # sampled tokens
    num_preemptions: int
    num_finished_requests: int
    num_graphs: int | None = None  # graphs the runner compiled or captured so far; None: eager runner
    spec_decode: SpecDecodeStats | None = None  # decode request-steps, drafts verified / accepted per depth
    # Prefix caching: tokens of admitted sequences looked up, and those found cached (0 when off).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: Any
    seqs: list[Sequence]
    arrival_time: float
    prompt_counted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, engine_config: EngineConfig, *, tokenizer=None, model_config=None,
                 worker=None, executor=None):
        """tokenizer / model_config / executor are built from engine_config when None (tests and
        tools may inject their own); worker: a single-rank executor over this Worker."""
        self.config = engine_config
        if tokenizer is None and not engine_config.skip_tokenizer_init:
            from deepinfer.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(engine_config.tokenizer)
        self.tokenizer = tokenizer
        if model_config is None:
            from deepinfer.config import ModelConfig
            model_config = ModelConfig.from_pretrained(engine_config.model)
        self.model_config = model_config
        engine_config.resolve(model_config)
        if executor is None and worker is not None:
            from deepinfer.executor.single_rank import SingleRankExecutor
            executor = SingleRankExecutor(worker)
        if executor is None:
            # one rank, or several with this process their driver (the followers started)
            from deepinfer.executor.base import build_executor
            executor = build_executor(model_config, engine_config)
        self.executor = executor
        self.worker = worker = executor.driver   # the driver's Worker: pool sizes, runner

        num_blocks, block_size = int(worker.num_kv_blocks), int(worker.block_size)
        # One sequence of max_model_len must fit the pool alone, or preemption could not
        # guarantee progress (the oldest sequence would evict everyone and still not fit).
        if (num_blocks - 1) * block_size < engine_config.max_model_len:
            raise ValueError(
                f"num_kv_blocks={num_blocks} (block_size={block_size}, block 0 reserved) holds "
                f"{(num_blocks - 1) * block_size} tokens, fewer than max_model_len="
                f"{engine_config.max_model_len}; raise num_kv_blocks / kv_cache_memory_bytes or "
                f"lower max_model_len")
        ep, cp = int(engine_config.expert_parallel_size), int(engine_config.context_parallel_size)
        self.block_manager = BlockManager(num_blocks, block_size, int(worker.num_state_slots),
                                          enable_prefix_caching=bool(worker.prefix_caching),
                                          num_groups=ep // cp if ep > cp else 1)
        self.scheduler = Scheduler(engine_config, self.block_manager,
                                   eos_token_ids=list(model_config.eos_token_ids or ()))
        self.vocab_size = int(model_config.vocab_size)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_finished_requests = 0
        self.last_step_timing: StepTiming | None = None
        self.timing_hook: Callable[[StepTiming], None] | None = None
        self._grammar_compiler = None  # structured_output.GrammarCompiler, built on first use
        self.rank_failure = None  # the RankFailure (executor/local_ranks.py) that ended this engine, once one did

    def close(self) -> None:
        """Release the executor's processes (the followers of a multi-rank model); idempotent. The
        engine takes no step after this."""
        self.executor.close()

    # ---- lost ranks (a model on several ranks) ----------------------------------------------
    def watch_ranks(self, callback: Callable[[BaseException], None]) -> None:
        """callback(RankFailure) on the ranks' watchdog thread as soon as a rank of the model is lost,
        step or no step (at once when one already is); never called on one rank. It must not call into
        the engine: it wakes the engine thread, which calls `check_ranks`."""
        self.executor.watch_ranks(callback)

    def check_ranks(self) -> None:
        """Raise the RankFailure of a lost rank, after failing every request (their blocks and slots
        freed) and tearing the ranks down; a no-op while every rank runs."""
        if self.rank_failure is None:
            failure = self.executor.rank_failure()
            if failure is None:
                return
            self._fail_everything(failure)
        raise self.rank_failure

    def _fail_everything(self, failure: BaseException) -> None:
        if self.rank_failure is not None:
            return
        self.rank_failure = failure
        failed = list(self.requests)
        for request_id in failed:
            self.abort_request(request_id)
        self.executor.teardown()
        cause = getattr(failure, "cause", None)
        logger.error("rank %s lost (%s): %d request(s) failed; the engine takes no more steps",
                     getattr(failure, "rank", None), cause or f"{failure}".splitlines()[0], len(failed))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, sampling_params=None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. prompt: str, list[int], or dict(prompt_token_ids=[...]) /
        dict(prompt="..."). Raises ValueError (and changes nothing) on bad input."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        self.check_ranks()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if sampling_params is None:
            sampling_params = SamplingParams()
        elif not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if self.tokenizer is None and sampling_params.stop_strings:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set); "
                             "use stop_token_ids instead")
        prompt_text, token_ids = self._tokenize(prompt, sampling_params)
        self._validate_prompt(token_ids)
        self._validate_logit_bias(sampling_params)
        compiled = self._compile_grammar(sampling_params)

        arrival = time.time() if arrival_time is None else arrival_time
        n = int(sampling_params.n)
        seqs = []
        for index in range(n):
            seq_id = next(self._seq_ids)
            seq = Sequence(
                request_id=request_id, seq_id=seq_id, prompt_token_ids=token_ids,
                sampling_params=sampling_params, prompt=prompt_text, index=index,
                arrival_time=arrival,
                seed=effective_seed(sampling_params.seed, self.config.seed,
                                    seq_id, index))
            if sampling_params.logprobs is not None:
                seq.logprobs = []
            if index == 0 and sampling_params.prompt_logprobs is not None:
                # The n samples share the prompt: the first one scores it; position 0 has no prefix.
                seq.prompt_logprobs = [None]
            seq.detokenizer = self._make_detokenizer(token_ids, sampling_params)
            if compiled is not None:
                seq.grammar = self._grammar_compiler.new_state(compiled)
            seqs.append(seq)
        self.requests[request_id] = _Request(request_id, prompt_text, list(token_ids),
                                             sampling_params, seqs, arrival)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt, sampling_params) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' (list[int]) or 'prompt' (str)")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a str, a list of token ids or a dict with prompt_token_ids, "
            f"got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt must not be empty")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set): pass token ids")
        return list(self.tokenizer.encode(text))

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (got 0 prompt tokens)")
        for i, t in enumerate(token_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt token at index {i} must be an int, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t} at index {i} is out of vocabulary: token ids must be "
                    f"in [0, {self.vocab_size})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is {max_len}: the prompt "
                f"must be shorter than max_model_len (at most {max_len - 1} tokens) to leave room "
                f"for one generated token")

    def _validate_logit_bias(self, sampling_params) -> None:
        for t in sampling_params.logit_bias or {}:
            if t >= self.vocab_size:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias token id {t} is out of vocabulary: token ids must be "
                                  f"in [0, {self.vocab_size})", t)

    def _compile_grammar(self, sampling_params):
        """The compiled grammar of a structured-output request (None otherwise); the compiler is
        built on first use (it indexes the whole vocabulary once)."""
        if sampling_params.structured_outputs is None:
            return None
        if self._grammar_compiler is None:
            from deepinfer.structured_output import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                     list(self.model_config.eos_token_ids or ()))
        return self._grammar_compiler.compile(sampling_params.structured_outputs)

    def _make_detokenizer(self, prompt_token_ids, sampling_params):
        if self.tokenizer is None:
            return None
        from deepinfer.tokenizer import OutputDetokenizer
        return OutputDetokenizer(self.tokenizer, sampling_params, prompt_token_ids)

    def abort_request(self, request_id: str):
        """Stop a request and free its cache. Returns its final RequestOutput (finish_reason
        "abort"), or None when the id is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        out = self._make_output(req)
        self._retire(req)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batch. Returns a RequestOutput for every request that got a token or finished."""
        self.check_ranks()
        timing = StepTiming()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.scheduled:
            try:
                result = self.executor.execute(sched.scheduled)
            except Exception as e:
                if not getattr(e, "engine_dead", False):   # a lost rank (RankFailure)
                    raise
                self._fail_everything(e)
                raise
        else:
            if self.scheduler.running:
                raise RuntimeError("scheduler made no progress with running sequences")
            result = None
        t2 = time.perf_counter()
        if sched.scheduled and all(item.is_decode for item in sched.scheduled):
            # the step-time model of speculative_verify="confidence" (spec/step_times.py)
            self.scheduler.spec_policy.step_times.record(len(sched.scheduled), sched.num_batched_tokens, t2 - t1)
        changed = self.scheduler.update(sched.scheduled, result)
        t3 = time.perf_counter()

        touched: dict[str, _Request] = {}
        for seq in changed:
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            self._num_generation_tokens += seq.num_last_emitted
            if not req.prompt_counted:
                req.prompt_counted = True
                self._num_prompt_tokens += len(req.prompt_token_ids)
        outputs = []
        for req in touched.values():
            outputs.append(self._make_output(req))
            if req.finished:
                self._retire(req)
        t4 = time.perf_counter()

        timing.schedule_s, timing.execute_s = t1 - t0, t2 - t1
        timing.update_s, timing.output_s = t3 - t2, t4 - t3
        timing.num_seqs = len(sched.scheduled)
        for item in sched.scheduled:
            if item.is_decode:
                timing.num_decode_tokens += item.num_new_tokens
            else:
                timing.num_prefill_tokens += item.num_new_tokens
        timing.num_sampled = sum(s.num_last_emitted for s in changed)
        timing.num_preempted = len(sched.preempted)
        self.last_step_timing = timing
        logger.debug("step: %d rows, %d prefill + %d decode tokens, %d sampled, %d preempted, %.2f ms "
                     "(execute %.2f ms)", timing.num_seqs, timing.num_prefill_tokens, timing.num_decode_tokens,
                     timing.num_sampled, timing.num_preempted, timing.total_s * 1e3, timing.execute_s * 1e3)
        if self.timing_hook is not None:
            self.timing_hook(timing)
        return outputs

    def _retire(self, req: _Request) -> None:
        del self.requests[req.request_id]
        self._num_finished_requests += 1

    def _make_output(self, req: _Request):
        """The request's state plus, per completion, what is new since its previous output.

        Nothing here copies a whole token or logprob list: a running completion gets ListPrefix
        snapshots, a finished one its sequence's own lists (the sequence never changes again).
        """
        completions = []
        for seq in req.seqs:
            delta_text, delta_ids, delta_logprobs = seq.take_delta()
            if seq.is_finished:
                token_ids, logprobs = seq.output_token_ids, seq.logprobs
            else:
                token_ids = ListPrefix(seq.output_token_ids)
                logprobs = ListPrefix(seq.logprobs) if seq.logprobs is not None else None
            completions.append(CompletionOutput(
                index=seq.index, text=seq.output_text, token_ids=token_ids,
                # Only rows that asked for logprobs are guaranteed to get them (vLLM: None).
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_logprobs))
        seqs = req.seqs
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=_min(s.first_scheduled_time for s in seqs),
            first_token_time=_min(s.first_token_time for s in seqs),
            last_token_time=_max(s.last_token_time for s in seqs),
            finished_time=_max(s.finished_time for s in seqs) if req.finished else None,
            num_decode_steps=sum(s.num_decode_steps for s in seqs),
            num_decode_tokens=sum(s.num_decode_tokens for s in seqs),
            num_draft_tokens=sum(s.num_draft_tokens for s in seqs),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in seqs),
            confidence_error_sum=sum(s.confidence_error_sum for s in seqs))
        # Prompt logprobs once the whole prompt is scored (from the first sampled token on); that list
        # never changes again, so it is handed out as is.
        first = seqs[0]
        prompt_logprobs = first.prompt_logprobs if first.prompt_logprobs is not None \
            and first.prompt_logprobs_done else None
        # The request's own prompt list (the engine never changes it), not a per-step copy.
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=completions,
                             finished=req.finished, metrics=metrics, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=first.num_cached_tokens)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            num_used_state_slots=bm.num_used_state_slots,
            num_free_state_slots=bm.num_free_state_slots,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_finished_requests=self._num_finished_requests,
            num_graphs=getattr(getattr(self.worker, "runner", None), "num_graphs", None),
            spec_decode=self.scheduler.spec_policy.stats.snapshot(),
            prefix_cache_queries=bm.prefix_cache.num_queried_tokens if bm.prefix_cache else 0,
            prefix_cache_hits=bm.prefix_cache.num_hit_tokens if bm.prefix_cache else 0)

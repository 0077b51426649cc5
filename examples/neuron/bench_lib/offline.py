"""Offline driver: LLMEngine in this process, a closed loop of `concurrency` requests in flight.

LLM.generate only returns finished requests, so the loop drives LLMEngine directly: add requests
until `concurrency` are in flight, step, and stamp every request that got new tokens with the time
the step returned (that is when a caller of the engine could see them).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time

import torch

from bench_lib.metrics import RequestResult


@dataclasses.dataclass
class EngineArgs:
    model: str
    accelerator: str | None
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    seed: int
    temperature: float
    weight_format: str = "auto"
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    attention_tp_size: int | None = None
    num_speculative_tokens: int = 0
    speculative_verify: str = "all"
    speculative_draft_vocab: str | None = None
    warmup_graphs: bool = False
    enable_prefix_caching: bool = True


class OfflineDriver:
    def __init__(self, args: EngineArgs):
        if args.accelerator:
            # Before the platform resolves: deepinfer/envs.py reads it when current_platform() runs.
            os.environ["DEEPINFER_ACCELERATOR"] = args.accelerator
            from deepinfer.platforms import reset_platform
            reset_platform()
        from deepinfer.engine.llm_engine import LLMEngine
        from deepinfer.engine_config import EngineConfig
        self.args = args
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager, seed=args.seed, weight_format=args.weight_format,
            context_parallel_size=args.context_parallel_size, expert_parallel_size=args.expert_parallel_size,
            attention_tp_size=args.attention_tp_size,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_verify=args.speculative_verify, enable_prefix_caching=args.enable_prefix_caching,
            speculative_draft_vocab=args.speculative_draft_vocab if args.num_speculative_tokens else None,
            warmup_graphs=args.warmup_graphs))
        self.load_s = time.perf_counter() - t0
        self.vocab_size = self.engine.vocab_size
        self._ids = itertools.count()
        self.step_buckets: collections.Counter = collections.Counter()
        self._record_buckets()

    def _record_buckets(self) -> None:
        """Count the bucket of every step (wraps this engine's strategy.prepare_host, nothing else; with
        data-parallel attention each group's share of a step counts once)."""
        strategy = self.engine.worker.runner.strategy
        prepare = strategy.prepare_host

        def counting_prepare(chunks, *bucket_chosen):   # a greedy speculative step passes its bucket
            step, bucket = prepare(chunks, *bucket_chosen)
            key = "eager" if bucket is None else f"T{bucket.num_tokens}xC{bucket.context}"
            self.step_buckets[key] += 1
            return step, bucket
        strategy.prepare_host = counting_prepare

    def close(self) -> None:
        """Stop the engine's follower processes (cp / ep > 1)."""
        self.engine.close()

    def prefix_cache_hits(self) -> int:
        """Prompt tokens the engine found in its prefix cache so far."""
        return self.engine.stats().prefix_cache_hits

    def spec_stats(self):
        """The engine's speculative-decoding counters now (spec/stats.SpecDecodeStats)."""
        return self.engine.stats().spec_decode

    @property
    def num_graphs(self) -> int | None:
        return getattr(self.engine.worker.runner, "num_graphs", None)

    def platform_info(self) -> dict:
        worker = self.engine.worker
        p, strategy = worker.platform, worker.runner.strategy
        spec = strategy.buckets
        return {"name": p.name, "is_host_mode": bool(p.is_host_mode), "device": str(p.device),
                "dist_backend": p.dist_backend, "compile_backend": getattr(p, "compile_backend", None),
                "runner_strategy": strategy.name, "weight_format": worker.weight_format,
                "bucket_spec": dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else None,
                "block_size": worker.block_size, "num_kv_blocks": worker.num_kv_blocks,
                "model_load_s": self.load_s, "torch_threads": torch.get_num_threads(),
                "layout": self.layout_info()}

    def layout_info(self) -> dict:
        """The ranks the model runs on (docs/architecture.md §8)."""
        worker = self.engine.worker
        groups = getattr(worker, "parallel", None)
        if groups is None:
            return {"world_size": 1, "cp": 1, "ep": 1, "attention_tp_size": 1, "dp": 1, "nnodes": 1}
        lay = groups.layout
        return {"world_size": lay.world_size, "cp": lay.cp, "ep": lay.ep, "attention_tp_size": lay.attn_tp,
                "dp": lay.dp, "nnodes": lay.nnodes}

    def run(self, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[RequestResult], float]:
        from deepinfer.sampling_params import SamplingParams
        params = SamplingParams(temperature=self.args.temperature, max_tokens=output_len,
                                min_tokens=output_len, ignore_eos=True, seed=self.args.seed)
        engine = self.engine
        results = [RequestResult(len(p), output_len) for p in prompts]
        inflight: dict[str, RequestResult] = {}
        next_i = 0
        t0 = time.perf_counter()
        while next_i < len(prompts) or inflight:
            while next_i < len(prompts) and len(inflight) < concurrency:
                r, request_id = results[next_i], f"bench-{next(self._ids)}"
                r.start = time.perf_counter()
                try:
                    engine.add_request(request_id, {"prompt_token_ids": prompts[next_i]}, params)
                    inflight[request_id] = r
                except ValueError as e:
                    r.fail(f"add_request rejected the prompt: {e}")
                    r.end = time.perf_counter()
                next_i += 1
            if not inflight:
                continue
            if not engine.has_unfinished_requests():
                self._fail_all(inflight, "the engine dropped in-flight requests")
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - counted as failed requests, the bench goes on
                self._fail_all(inflight, f"engine step failed: {e!r}")
                continue
            now = time.perf_counter()
            for out in outputs:
                r = inflight.get(out.request_id)
                if r is None:
                    continue
                n = len(out.outputs[0].token_ids)
                if n > r.output_len:
                    r.token_times.append(now)
                    r.output_len = n
                if out.finished:
                    if out.outputs[0].finish_reason not in ("length", "stop"):
                        r.fail(f"finished with finish_reason={out.outputs[0].finish_reason!r}")
                    r.end = now
                    del inflight[out.request_id]
        ends = [r.end for r in results if r.end is not None]
        return results, (max(ends) if ends else time.perf_counter()) - t0

    def _fail_all(self, inflight: dict, message: str) -> None:
        now = time.perf_counter()
        for request_id, r in inflight.items():
            r.fail(message)
            r.end = now
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the request is already counted as failed
                pass
        inflight.clear()

"""One rank: selects its device through the platform, builds the model and its caches, and holds the
ModelRunner (worker/model_runner.py) that runs each step; turns scheduled sequences into a StepResult
(step_result.py), through the speculative step (spec/decoder.py) when drafts are on."""
import logging
import time

import torch

from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.layers.token_scores import TokenScores
from deepinfer.outputs import Logprob
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from deepinfer.platforms import current_platform
from deepinfer.step_result import StepResult, sampled_rows
from deepinfer.stop_rules import banned_token_ids
from deepinfer.worker import cache_engine, startup_log
from deepinfer.worker.model_runner import ModelRunner, SampleRequest, ScoreRequest
from deepinfer.worker.runners import EagerStrategy, strategy_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, model_config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return getattr(model_config, "torch_dtype", None) or torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected 'auto', 'bfloat16' or 'float32', got {dtype!r}")
    return _DTYPES[dtype]


def build_model(model_config, model_dir: str, dtype: torch.dtype, progress: bool = True,
                platform=None, weight_format: str = "dense", parallel=None,
                shared_tables=None, draft_vocab: str | None = None) -> DeepseekV4Model:
    """The model with its checkpoint loaded. weight_format "packed": every tensor the checkpoint stores
    quantized (fp8 / fp4 codes with ue8m0 scales) stays in that form (layers/packed_weights.py), in
    the bytes the platform's kernels read; "dense": dequantized once, here. The model is built on the
    meta device and materialized by the loader, so no weight is allocated twice. parallel: this rank's
    ParallelGroups (distributed/groups.py) when one model runs across ranks: the rank builds and reads
    only its slices (model_executor/shard_plan.py).
    shared_tables (distributed/shared_tables.py SharedEngramTables): the Engram tables are mapped from
    the host's shared memory instead of loaded; None: so whenever `parallel` puts several ranks on this
    host (docs/neuron.md §5.9); False: never.
    draft_vocab: a draft-vocabulary file (models/draft_vocab.py), applied before the platform lays out
    its kernels' weights, so the draft heads get the LM head's treatment."""
    from deepinfer.model_executor.loader import load_checkpoint, stored_formats
    if weight_format not in ("packed", "dense"):
        raise ValueError(f"weight_format: expected 'packed' or 'dense', got {weight_format!r}")
    formats = stored_formats(model_dir) if weight_format == "packed" else {}
    with torch.device("meta"):
        model = DeepseekV4Model(model_config, dtype, platform=platform, parallel=parallel)
    model.use_weight_formats(formats)
    if shared_tables is None and parallel is not None:
        from deepinfer.distributed.shared_tables import SharedEngramTables
        shared_tables = SharedEngramTables.for_layout(parallel.layout)
    shared_tables = shared_tables or None
    skip = shared_tables.names(model) if shared_tables is not None else ()
    t0 = time.perf_counter()
    load_checkpoint(model, model_dir, dtype, progress=progress, skip=skip)  # also runs model.post_load()
    startup_log.log_weights(model, model_dir, weight_format, time.perf_counter() - t0, parallel)
    if shared_tables is not None:
        shared_tables.attach(model, model_dir, platform)
    if draft_vocab is not None:
        from deepinfer.model_executor.models.draft_vocab import read_draft_vocab
        ids = read_draft_vocab(draft_vocab, model_config.vocab_size)
        model.use_draft_vocab(ids)
        if progress:
            logger.info("draft vocabulary: %d tokens (%s); the draft heads read only their rows", len(ids),
                        draft_vocab)
    if platform is not None:
        convert = platform.fp8_weight_codes
        model.map_fp8_codes(convert if shared_tables is None else shared_tables.keep_shared(convert))
        platform.kernel_weight_layouts(model)
    model.shared_tables = shared_tables   # what the rank mapped (segment names), None when nothing
    model.eval()
    if platform is not None and platform.device.type != "cpu":
        # the Engram tables are no part of what this moves (layers/engram_host.py, docs/neuron.md §5.9)
        model.to(platform.device)
    return model


def kv_pool_blocks(engine_config, block_size: int, bytes_per_block: int) -> int:
    """KV blocks of the pool: engine_config.num_kv_blocks, else as many as kv_cache_memory_bytes holds
    (at most what max_num_seqs sequences of max_model_len need), never fewer than one such sequence."""
    ec = engine_config
    max_len = int(ec.max_model_len)
    min_blocks = -(-max_len // block_size) + 1
    if ec.num_kv_blocks is not None:
        if int(ec.num_kv_blocks) < min_blocks:
            raise ValueError(f"num_kv_blocks: must be >= {min_blocks} to hold one max_model_len "
                             f"({max_len}) sequence plus the scratch block, got {ec.num_kv_blocks}")
        return int(ec.num_kv_blocks)
    budget = int(ec.kv_cache_memory_bytes)
    want = -(-max_len // block_size) * int(ec.max_num_seqs) + 1
    return max(min_blocks, min(want, budget // max(1, bytes_per_block)))


def prefix_caching_supported(engine_config, strategy_cls, log: bool = True) -> bool:
    """Whether this worker caches prefixes: enable_prefix_caching, and an eager runner. The graph
    runners (CUDA graphs, Neuron regions) bake every step's index tensors into static shapes, and the
    snapshot writes of model_executor/prefix_state.py have no static size there yet, so with them the
    option is turned off (docs/prefix_caching.md)."""
    if not engine_config.enable_prefix_caching:
        return False
    cls = getattr(strategy_cls, "func", strategy_cls)   # a functools.partial of a strategy class
    if not (isinstance(cls, type) and issubclass(cls, EagerStrategy)):
        if log:
            logger.warning("prefix caching is off: the %s runner has no static-shape snapshot writes "
                           "(docs/prefix_caching.md); enforce_eager runs it with prefix caching",
                           getattr(cls, "name", cls))
        return False
    return True


class Worker:
    def __init__(self, model_config, engine_config, model: DeepseekV4Model | None = None, strategy_cls=None,
                 platform=None, rank: int = 0, parallel=None, transport=None, shared_tables=None, **strategy_kw):
        """strategy_cls / strategy_kw: a runner strategy other than the platform's (tests).
        rank: the local rank (the device index on this host). parallel: the rank's ParallelGroups and
        transport its StepFanout (executor/step_fanout.py) when the model runs on several ranks
        (worker/step_transport.py; one rank by default); shared_tables: build_model's (None: its default)."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.platform = platform or current_platform()
        self.platform.validate_config(engine_config, model_config)
        # before anything touches the device: on Neuron this picks the rank's core
        self.rank = int(rank)
        self.platform.set_device(self.rank)
        self.parallel = parallel
        self.dtype = resolve_dtype(engine_config.dtype, model_config)
        self.weight_format = (self.platform.default_weight_format if engine_config.weight_format == "auto"
                              else engine_config.weight_format)
        progress = parallel is None or parallel.layout.is_driver   # one progress bar per model, not per rank
        if progress:
            startup_log.log_config(engine_config, self.platform, self.dtype, self.weight_format)
        self.model = model if model is not None else build_model(model_config, engine_config.model, self.dtype,
                                                                 progress=progress, platform=self.platform,
                                                                 weight_format=self.weight_format,
                                                                 parallel=parallel, shared_tables=shared_tables,
                                                                 draft_vocab=engine_config.speculative_draft_vocab)
        cfg = model_config
        self.num_speculative_tokens = int(engine_config.num_speculative_tokens)
        extra_rows = cache_engine.speculative_ring_rows(self.num_speculative_tokens)
        self.block_size = int(engine_config.block_size or cache_engine.default_block_size(cfg))
        self.num_state_slots = int(engine_config.max_num_seqs) + 1  # slot 0 is scratch
        self.kv_cache_mode = engine_config.kv_cache_mode
        if strategy_cls is None:
            strategy_cls = EagerStrategy if engine_config.enforce_eager else strategy_class(
                self.platform.runner_strategy)
        self.prefix_caching = prefix_caching_supported(engine_config, strategy_cls, log=progress)
        self.bytes_per_block = cache_engine.bytes_per_block(cfg, self.block_size, self.dtype, self.kv_cache_mode,
                                                            prefix_snapshots=self.prefix_caching)
        self.num_kv_blocks = kv_pool_blocks(engine_config, self.block_size, self.bytes_per_block)
        cache = cache_engine.allocate_cache(cfg, self.num_state_slots, self.num_kv_blocks, self.block_size,
                                            self.dtype, device=self.platform.device, mode=self.kv_cache_mode,
                                            fp8_max=self.platform.fp8_max, extra_ring_rows=extra_rows,
                                            prefix_snapshots=self.prefix_caching)
        if progress:
            startup_log.log_kv_pool(self.num_kv_blocks, self.block_size, self.bytes_per_block, self.kv_cache_mode,
                                    int(engine_config.max_model_len), int(engine_config.max_num_seqs))
        layout = cache_engine.cache_layout(cfg, self.num_state_slots, self.block_size,
                                           getattr(self.model, "engram_spec", None), extra_ring_rows=extra_rows)
        buckets = None if strategy_cls is EagerStrategy else self.platform.bucket_spec(engine_config)
        if buckets is not None:
            strategy_kw.setdefault("buckets", buckets)
        strategy = strategy_cls(self.model, layout, platform=self.platform, **strategy_kw)
        if progress:
            startup_log.log_runner(strategy.name, buckets, bool(engine_config.warmup_graphs))
        self.runner = ModelRunner(self.model, cache, layout, strategy, transport=transport)
        self.eos_ids = list(cfg.eos_token_ids or [])
        self.spec = None
        if self.num_speculative_tokens:
            from deepinfer.spec.decoder import SpecDecoder
            self.model.enable_drafting()
            self.spec = SpecDecoder(self.runner, self.num_speculative_tokens, int(engine_config.max_model_len),
                                    self.eos_ids, int(cfg.dspark_noise_token_id))
        self.warmup_s, self.warmup_graphs = 0.0, 0
        if engine_config.warmup_graphs:
            t0 = time.perf_counter()
            self.warmup_graphs = self.runner.warm_up()
            self.warmup_s = time.perf_counter() - t0
            logger.info("warm-up: %d graphs in %.1f s", self.warmup_graphs, self.warmup_s)

    @property
    def cache(self):
        return self.runner.cache

    def _sample_request(self, seq) -> SampleRequest:
        """How seq's next token is sampled: the live token lists (the sampler reads them only for
        penalised rows), the min_tokens bans and the grammar's bitmask (structured_output.py)."""
        return SampleRequest(seq.sampling_params, len(seq.token_ids), seq.seed,
                             tuple(banned_token_ids(seq, self.eos_ids)),
                             prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids,
                             bitmask=seq.grammar.bitmask if seq.grammar is not None else None)

    def execute(self, scheduled) -> StepResult:
        """One engine step: the scheduled rows as chunks, each sampling row's request, through the runner.

        A prompt chunk of a request with prompt_logprobs asks for the logits rows of the positions it
        scores too (they come right before its sampling row, if any); their entries land in
        ScheduledSeq.prompt_logprobs, which the scheduler commits with the step.
        """
        chunks, scores, scored_rows = [], [], []
        for i, s in enumerate(scheduled):
            positions = s.prompt_logprob_positions
            if len(positions):
                # Logits rows are the chunk's last num_logits tokens, so the scored rows (positions p - 1)
                # must end at the chunk's last token, or right before its sampling row.
                assert positions.stop == s.start_pos + s.num_new_tokens + (0 if s.do_sample else 1), \
                    "scored prompt rows must be the chunk's last logits rows"
                targets = tuple(s.seq.token_ids[p] for p in positions)
                scores.append(ScoreRequest(i, targets, int(s.seq.sampling_params.prompt_logprobs)))
                scored_rows.append(s)
            # A decode row with drafts feeds [x0, d_0 .. d_{n-1}] and verifies each (spec/decoder.py).
            drafts = s.draft_token_ids
            chunks.append(SeqChunk(slot=s.seq.state_slot, ctx_len=s.seq.num_computed_tokens,
                                   num_new=s.num_new_tokens, block_table=s.seq.block_table,
                                   token_ids=s.seq.token_ids + drafts if drafts else s.seq.token_ids,
                                   num_logits=len(positions) + ((1 + len(drafts)) if s.do_sample else 0),
                                   restore_len=s.restore_len, snapshot_upto=s.snapshot_upto))
        if self.spec is not None:
            plain = [self._sample_request(s.seq) for s in scheduled if s.do_sample and not s.draft_token_ids]
            step, results = self.spec.execute(scheduled, chunks, plain, scores)
        else:
            samples = [self._sample_request(s.seq) for s in scheduled if s.do_sample]
            out = self.runner.run(chunks, samples, scores or None)
            step, results = StepResult(sampled_rows(out.sampled)), out.scores
        for s, req, result in zip(scored_rows, scores, results or ()):
            s.prompt_logprobs = prompt_logprob_entries(req.target_ids, result)
        return step


def prompt_logprob_entries(target_ids, scores: TokenScores) -> list[dict[int, Logprob]]:
    """{token id: Logprob} per scored token: the known token first, then the top-k."""
    logprobs, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    top_ids, top_lps = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    entries = []
    for r, tid in enumerate(target_ids):
        entry = {int(tid): Logprob(logprobs[r], ranks[r])}
        for rank, (t, lp) in enumerate(zip(top_ids[r], top_lps[r]), start=1):
            entry.setdefault(int(t), Logprob(lp, rank))
        entries.append(entry)
    return entries

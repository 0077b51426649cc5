"""One rank: the model, its caches and a graph runner; turns scheduled sequences into sampled tokens."""
import logging
import time

import torch

from deepinfer.model_executor.forward_meta import SeqChunk
from deepinfer.model_executor.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from deepinfer.platforms import current_platform
from deepinfer.stop_rules import banned_token_ids
from deepinfer.worker import cache_engine
from deepinfer.worker.graph_runner import EagerRunner

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
                platform=None) -> DeepseekV4Model:
    from deepinfer.model_executor.loader import load_checkpoint
    model = DeepseekV4Model(model_config, dtype, platform=platform)
    load_checkpoint(model, model_dir, dtype, progress=progress)  # also runs model.post_load()
    model.eval()
    if platform is not None and platform.device.type != "cpu":
        model.to(platform.device)
    return model


class Worker:
    def __init__(self, model_config, engine_config, model: DeepseekV4Model | None = None, runner_cls=None,
                 platform=None):
        self.model_config = model_config
        self.engine_config = engine_config
        self.platform = platform or current_platform()
        self.platform.validate_config(engine_config, model_config)
        self.dtype = resolve_dtype(engine_config.dtype, model_config)
        t0 = time.perf_counter()
        self.model = model if model is not None else build_model(model_config, engine_config.model, self.dtype,
                                                                 platform=self.platform)
        self.load_time_s = time.perf_counter() - t0
        cfg = model_config
        self.block_size = int(engine_config.block_size or cache_engine.default_block_size(cfg))
        self.num_state_slots = int(engine_config.max_num_seqs) + 1  # slot 0 is scratch
        self.kv_cache_mode = engine_config.kv_cache_mode
        self.bytes_per_block = cache_engine.bytes_per_block(cfg, self.block_size, self.dtype, self.kv_cache_mode)
        max_len = int(engine_config.max_model_len)
        min_blocks = -(-max_len // self.block_size) + 1
        if engine_config.num_kv_blocks is not None:
            self.num_kv_blocks = int(engine_config.num_kv_blocks)
            if self.num_kv_blocks < min_blocks:
                raise ValueError(f"num_kv_blocks: must be >= {min_blocks} to hold one max_model_len "
                                 f"({max_len}) sequence plus the scratch block, got {self.num_kv_blocks}")
        else:
            budget = int(engine_config.kv_cache_memory_bytes)
            want = -(-max_len // self.block_size) * int(engine_config.max_num_seqs) + 1
            self.num_kv_blocks = max(min_blocks, min(want, budget // max(1, self.bytes_per_block)))
        self.cache = cache_engine.allocate_cache(cfg, self.num_state_slots, self.num_kv_blocks, self.block_size,
                                                 self.dtype, device=self.platform.device, mode=self.kv_cache_mode)
        self.layout = cache_engine.cache_layout(cfg, self.num_state_slots, self.block_size,
                                                getattr(self.model, "engram_spec", None))
        if runner_cls is None:
            runner_cls = EagerRunner if engine_config.enforce_eager else self.platform.graph_runner_cls
        self.runner = runner_cls(self.model, self.layout)
        self.warmup_s, self.warmup_graphs = 0.0, 0
        if engine_config.warmup_graphs:
            t0 = time.perf_counter()
            self.warmup_graphs = self.runner.warm_up(self.cache)
            self.warmup_s = time.perf_counter() - t0
            logger.info("warm-up: %d graphs in %.1f s", self.warmup_graphs, self.warmup_s)
        self.sampler = Sampler()
        self.eos_ids = list(getattr(cfg, "eos_token_ids", []) or [])
        self.last_forward_s = 0.0
        self.last_prepare_s = 0.0
        self.last_sample_s = 0.0

    @torch.inference_mode()
    def execute(self, scheduled) -> SamplerOutput:
        t0 = time.perf_counter()
        chunks = [SeqChunk(slot=s.seq.state_slot, ctx_len=s.seq.num_computed_tokens, num_new=s.num_new_tokens,
                           block_table=s.seq.block_table, token_ids=s.seq.token_ids,
                           num_logits=1 if s.do_sample else 0) for s in scheduled]
        step, bucket = self.runner.prepare(chunks)
        t1 = time.perf_counter()
        logits = self.runner.execute(step, self.cache, bucket)
        n_real = sum(min(c.num_logits, c.num_new) for c in chunks)
        logits = logits[:n_real]
        t2 = time.perf_counter()
        rows = [s for s in scheduled if s.do_sample]
        batch = SamplingBatch.build([s.seq.sampling_params for s in rows],
                                    [len(s.seq.token_ids) for s in rows],
                                    seeds=[s.seq.seed for s in rows],
                                    banned_ids_per_row=[banned_token_ids(s.seq, self.eos_ids) for s in rows],
                                    device=logits.device)
        out = self.sampler.forward(logits, batch)
        t3 = time.perf_counter()
        self.last_prepare_s, self.last_forward_s, self.last_sample_s = t1 - t0, t2 - t1, t3 - t2
        return out

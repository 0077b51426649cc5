"""The INFO lines a rank logs while it starts: the resolved configuration, the weights it loaded and
the KV pool it allocated, so `LLM(...)` and `deepinfer serve` say what they built (the level is
DEEPINFER_LOG_LEVEL, deepinfer/logging_config.py). Each function formats facts its caller owns."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def size_text(nbytes: int) -> str:
    """GiB from 128 MiB up, MiB below (a tiny checkpoint is a few MiB)."""
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:.1f} MiB"


def log_config(engine_config, platform, dtype: torch.dtype, weight_format: str) -> None:
    ec = engine_config
    parallel = f"cp={ec.context_parallel_size} ep={ec.expert_parallel_size} nnodes={ec.nnodes}"
    if ec.attention_tp_size is not None:
        parallel += f" attention_tp={ec.attention_tp_size}"
    speculative = (f"{ec.num_speculative_tokens} tokens, verify {ec.speculative_verify}"
                   if ec.num_speculative_tokens else "off")
    logger.info("engine config: model=%s platform=%s%s dtype=%s weight_format=%s kv_cache_mode=%s "
                "max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d parallel=(%s) speculative=%s",
                ec.model, platform.name, " (host mode)" if platform.is_host_mode else "",
                str(dtype).removeprefix("torch."), weight_format, ec.kv_cache_mode, ec.max_model_len,
                ec.max_num_seqs, ec.max_num_batched_tokens, parallel, speculative)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied or shared
    tensors are one allocation)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def log_weights(model: torch.nn.Module, model_dir: str, weight_format: str, seconds: float, parallel) -> None:
    where = "" if parallel is None or parallel.layout.world_size == 1 else f" (rank {parallel.layout.rank})"
    logger.info("weights loaded%s: %s (%s) from %s in %.2f s", where, size_text(model_bytes(model)), weight_format,
                model_dir, seconds)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """Sequences of max_model_len tokens the pool holds at once (block 0 is the scratch block)."""
    return (num_blocks - 1) / -(-max_model_len // block_size)


def log_runner(strategy_name: str, buckets, warmup: bool) -> None:
    if buckets is None:
        logger.info("runner: %s", strategy_name)
    else:
        logger.info("runner: %s over %s; graphs are built %s", strategy_name, buckets,
                    "now (warmup_graphs)" if warmup else "on first use (warmup_graphs builds them at start)")


def log_kv_pool(num_blocks: int, block_size: int, bytes_per_block: int, mode: str, max_model_len: int,
                max_num_seqs: int) -> None:
    logger.info("KV cache: %d blocks of %d tokens, %s (%s, %d B per block); max concurrency at "
                "max_model_len %d: %.2fx (max_num_seqs %d)", num_blocks, block_size,
                size_text(num_blocks * bytes_per_block), mode, bytes_per_block, max_model_len,
                max_concurrency(num_blocks, block_size, max_model_len), max_num_seqs)

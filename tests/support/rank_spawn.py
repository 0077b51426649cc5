"""Run one model across real processes (gloo, env:// rendezvous on a free port) and compare with one rank.

`run_ranks(world, jobs)` spawns `world` processes (torch.multiprocessing, spawn), each of which runs
every job in order: build its ParallelGroups for the job's layout, build the model with
`worker.build_model(..., parallel=groups)` from a checkpoint (so the rank reads only its slices),
then drive the real ModelRunner (eager, or the host-mode Neuron region strategy) through a prompt
step and greedy decode steps over the prompts of its data-parallel group. Each rank writes its
logits, tokens and (optionally) the collectives of one decode step to a file; the parent reads them.
`reference(job)` runs the same prompts on one rank, in the calling process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

TIMEOUT_S = 300   # generous: the suite shares 2 cores with other jobs (a 4-rank spawn took 84 s at load 11)


@dataclass
class Job:
    ckpt: str
    cp: int = 1
    ep: int = 1
    attn_tp: int = 1
    prompts: list = field(default_factory=list)   # per data-parallel group: a list of prompts
    steps: int = 3                                # logits steps: the prompt step, then greedy decodes
    weight_format: str = "dense"
    strategy: str = "eager"                       # "eager" | "neuron" (host-mode region graphs)
    record: bool = False                          # log the collectives of the first decode step
    capacity: int | None = None                   # force the capacity-bounded expert form (slots per
                                                  # expert) on fixed-shape steps of >= 16 rows
    sampling: list | None = None                  # SamplingParams per prompt: every step samples
                                                  # through the runner (its next token is the sample)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strategy(platform, kind: str, regions=None):
    from deepinfer.worker.runners import EagerStrategy
    if kind == "eager":
        return EagerStrategy, {}
    from deepinfer.model_executor.static_step import BucketSpec
    from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy
    buckets = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=(16,), max_model_len=64)
    return NeuronRegionStrategy, {"platform": platform, "buckets": buckets, "regions": regions}


def drive(model, job: Job, prompts: list[list[int]], platform=None, regions=None) -> dict:
    """The job's steps on one model (one rank's, or the whole one): logits per step, tokens."""
    from deepinfer.distributed import comm
    from deepinfer.model_executor.forward_meta import SeqChunk
    from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
    from deepinfer.worker.model_runner import ModelRunner, SampleRequest
    cfg = model.cfg
    bs = default_block_size(cfg)
    n = len(prompts)
    blocks_each = 8
    layout = cache_layout(cfg, n + 1, bs, model.engram_spec)
    cache = allocate_cache(cfg, n + 1, 1 + n * blocks_each, bs, torch.float32,
                           fp8_max=platform.fp8_max if platform is not None else 448.0)
    cls, kw = _strategy(platform, job.strategy, regions)
    runner = ModelRunner(model, cache, layout, cls(model, layout, **kw))
    local = _keep_local_logits(runner) if job.sampling else None
    tokens = [list(p) for p in prompts]
    done = [0] * n
    logits_out, records, sampled, whole = [], None, [], []
    for step in range(job.steps):
        chunks = [SeqChunk(slot=i + 1, ctx_len=done[i], num_new=len(tokens[i]) - done[i],
                           block_table=list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
                           token_ids=tokens[i], num_logits=1) for i in range(n)]
        samples = None if not job.sampling else [SampleRequest(job.sampling[i], len(tokens[i]), job.sampling[i].seed)
                                                 for i in range(n)]
        if job.record and step == 1:
            with comm.record_collectives() as log:
                out = runner.run(chunks, samples)
            records = list(log)
        else:
            out = runner.run(chunks, samples)
        logits = out.logits
        if samples is None:
            logits_out.append(logits.clone())
            nxt = [int(logits[i].argmax()) for i in range(n)]
        else:
            sampled.append(_host(out.sampled))
            nxt = out.sampled.token_ids.tolist()
            # the same step's logits as whole rows (one more gather on a vocabulary-split model),
            # sampled the single-rank way: the candidate route must give exactly this
            mine = local[-1][:n]
            rows = mine if runner.vocab_shard is None else runner.vocab_shard.gather_full(mine)
            whole.append(_host(runner.sample(rows, samples)))
            logits_out.append(rows.clone())
        for i in range(n):
            done[i] = len(tokens[i])
            tokens[i].append(nxt[i])
    return {"logits": logits_out, "tokens": [t[len(p):] for t, p in zip(tokens, prompts)], "records": records,
            "sampled": sampled, "whole_sampled": whole}


def _keep_local_logits(runner) -> list:
    """Make the runner's strategy keep each step's logits (padding rows after the real ones), as this
    rank computed them."""
    kept, forward = [], runner.strategy.forward

    def keep(step, cache, bucket):
        out = forward(step, cache, bucket)
        kept.append(out.clone())
        return out
    runner.strategy.forward = keep
    return kept


def _host(out) -> dict:
    """A SamplerOutput's tensors (None where absent), for torch.save."""
    names = ("token_ids", "logprobs", "token_ranks", "top_ids", "top_logprobs")
    return {k: None if getattr(out, k) is None else getattr(out, k).cpu() for k in names}


def _load(job: Job, parallel=None):
    from deepinfer.config import ModelConfig
    from deepinfer.worker.worker import build_model
    platform = None
    if job.strategy == "neuron":
        from deepinfer.platforms.neuron.platform import NeuronPlatform
        platform = NeuronPlatform(host=True)
    cfg = ModelConfig.from_pretrained(job.ckpt)
    model = build_model(cfg, job.ckpt, torch.float32, progress=False, platform=platform,
                        weight_format=job.weight_format, parallel=parallel)
    return model, platform


_MODELS: dict = {}


def reference(job: Job) -> list[dict]:
    """One rank, the whole model, eager (on the job's platform: the Neuron host-mode kernels for a
    region job, whose region graphs the single-rank tests already hold to eager): the run of each
    data-parallel group's prompts. Models are cached per checkpoint, weight format and platform."""
    key = (job.ckpt, job.weight_format, job.strategy)
    if key not in _MODELS:
        _MODELS.clear()   # one whole model at a time
        _MODELS[key] = _load(job)
    model, platform = _MODELS[key]
    eager = dataclasses.replace(job, strategy="eager")
    return [drive(model, eager, prompts, platform) for prompts in job.prompts]


def expected_collectives(job: Job, num_layers: int, rows: int, dim: int, vocab: int) -> list[tuple]:
    """(op, group size) of one decode step by the design (docs/neuron.md §5.5, §5.6): per decoder
    layer one lane all-reduce of the attention output, then the MoE's combine (an all-reduce when
    the tokens are replicated in the EP group, else the dispatch all-gather and the reduce-scatter;
    the split shared expert rides in it); with cp > 1 the step ends with the all-gather of the LM
    head's vocabulary slices (whole rows: these steps are run without samples)."""
    per_layer = []
    if job.attn_tp > 1:
        per_layer.append(("all_reduce", job.attn_tp, rows * dim * 4))
    if job.ep > 1:
        if job.ep <= job.cp:
            per_layer.append(("all_reduce", job.ep, rows * dim * 4))
        else:
            per_layer += [("all_gather", job.ep, None), ("reduce_scatter", job.ep, job.ep * rows * dim * 4)]
    head = [("all_gather", job.cp, rows * vocab * 4 // job.cp)] if job.cp > 1 else []
    return per_layer * num_layers + head


def _force_capacity(cap: int | None) -> None:
    from deepinfer.model_executor.layers import ep_moe
    if not hasattr(ep_moe, "_policy"):
        ep_moe._policy = ep_moe.capacity
    ep_moe.capacity = ep_moe._policy if cap is None else (lambda moe, rows: cap if rows >= 16 else None)


def _child(rank: int, world: int, port: int, jobs: list[Job], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from deepinfer.distributed.groups import ParallelGroups
    from deepinfer.distributed.parallel_layout import ParallelLayout
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        for j, job in enumerate(jobs):
            _force_capacity(job.capacity)
            layout = ParallelLayout(rank=rank, cp=job.cp, ep=job.ep, attn_tp=job.attn_tp)
            groups = ParallelGroups.create(layout, "gloo")
            model, platform = _load(job, groups)
            result = drive(model, job, job.prompts[layout.dp_rank], platform)
            result["state_dict_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            torch.save(result, out / f"job{j}.rank{rank}.pt")
            del model
        dist.barrier()
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, jobs: list[Job], timeout: float = TIMEOUT_S) -> list[list[dict]]:
    """results[job][rank] of every job run on `world` spawned ranks; raises with a rank's traceback."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="deepinfer-ranks-") as tmp:
        ctx = mp.start_processes(_child, args=(world, free_port(), jobs, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
        except Exception as e:
            errors = sorted(Path(tmp).glob("error.rank*.txt"))
            if errors:
                raise RuntimeError(f"{errors[0].name}:\n{errors[0].read_text()}") from e
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return [[torch.load(Path(tmp) / f"job{j}.rank{r}.pt") for r in range(world)] for j in range(len(jobs))]

"""One rank of tests/process/test_shared_tables.py: joins a gloo group (env:// rendezvous), builds the tiny
model with its Engram tables mapped from the host's shared memory, and saves what the test compares.

    python -m tests.support.shared_tables_rank RANK WORLD MODEL_DIR OUT_DIR PLATFORM WEIGHT_FORMAT MODE TIMEOUT_S

MODE: "ok"; "die_after_map" (the last rank SIGKILLs itself once its model holds the mapped tables);
"die_before_map" (the last rank exits before building its model, so it never maps); "mismatch" (the
last rank builds the other weight format, so its tables have another size than the creator's)."""
import os
import signal
import sys
import types

import torch
import torch.distributed as dist

from deepinfer.config import ModelConfig
from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.distributed.shared_tables import SharedEngramTables
from deepinfer.model_executor.layers.engram_host import table_rows
from deepinfer.platforms import make_platform
from deepinfer.worker.worker import build_model


def mapping_of(ptr: int) -> str:
    """The /proc/self/maps line of the mapping holding address ptr."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.strip()
    return ""


def engram_outputs(model, seed: int = 0) -> dict:
    """Each Engram layer's gated trunk for fixed rows and inputs: the rows fetched from its host table
    as the host stage of a step does (layers/engram_host.py), then the module's own forward."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in model.layers:
        if not hasattr(layer, "engram"):
            continue
        e = layer.engram
        rows_total = e.embed.weight.shape[0]
        k = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        rows = torch.randint(0, rows_total, (5, k), generator=g)
        rows[0, 0] = -1                       # a missing lookup reads zeros
        x = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=g).to(model.dtype)
        fetched = table_rows(e.embed, rows, model.dtype)
        out[layer.layer] = e(x, types.SimpleNamespace(k=model.kernels), fetched)
    return out


def main(rank, world, model_dir, out_dir, platform, weight_format, mode, timeout_s):
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    # two ranks: a really split model (lanes of 2, experts over 2); three: cp = 3, nothing split
    layout = ParallelLayout(rank=rank, cp=world, ep=2, attn_tp=2) if world == 2 else ParallelLayout(rank, cp=world)
    groups = ParallelGroups.create(layout, "gloo")
    # rank 0 of the 2-rank run leaves it to build_model (parallel alone turns the sharing on)
    tables = None if (world == 2 and rank == 0) else SharedEngramTables.for_layout(layout, timeout_s=timeout_s)
    last = rank == world - 1
    if mode == "die_before_map" and last:
        os._exit(3)
    if mode == "mismatch" and last:
        weight_format = "dense" if weight_format == "packed" else "packed"
    cfg = ModelConfig.from_pretrained(model_dir)
    try:
        model = build_model(cfg, model_dir, torch.float32, progress=False, platform=make_platform(platform),
                            weight_format=weight_format, parallel=groups, shared_tables=tables)
    except RuntimeError as e:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(str(e))
        sys.exit(2)
    if mode == "die_after_map" and last:
        os.kill(os.getpid(), signal.SIGKILL)
    record = {"segments": dict(model.shared_tables.segment_names), "maps": {}, "tables": {}, "outputs": engram_outputs(model)}
    for layer in model.layers:
        if hasattr(layer, "engram"):
            for leaf, t in [*layer.engram.embed.named_parameters(), *layer.engram.embed.named_buffers()]:
                name = f"layers.{layer.layer}.engram.embed.{leaf}"
                record["tables"][name] = t.clone()
                record["maps"][name] = mapping_of(t.data_ptr())
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5], a[6], float(a[7]))

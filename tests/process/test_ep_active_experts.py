"""Expert parallelism with the active-experts form on 2 real gloo ranks (layers/ep_moe.py,
layers/moe.py `active_local_experts`): a fixed-shape step where one rank's experts get no pair
(it reads none of its expert weights) and the other rank's get every pair (all of its experts hit),
in both EP modes (tokens replicated: one all-reduce; tokens per rank: all-gather + reduce-scatter),
equal to one rank running every expert."""
import datetime
import os
import tempfile
import traceback
from pathlib import Path

import torch

from deepinfer.model_executor.tiny_checkpoint import v41_tiny_config
from tests.support.rank_spawn import free_port

TOL = 1e-5   # fp32: only the order the two ranks' partial sums are added in differs


def _moe(cfg, experts, ep, replicated):
    from deepinfer.model_executor.models.v4_ffn import MoE
    moe = MoE(cfg, False, torch.float32, experts=experts, ep=ep, tokens_replicated=replicated)
    for e, expert in moe.experts.items():
        gen = torch.Generator().manual_seed(int(e))
        for w in (expert.w1, expert.w2, expert.w3):
            w.weight.data.copy_(torch.randn(w.weight.shape, generator=gen) * 0.1)
    moe.pack()
    return moe


def _child(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from deepinfer.config import ModelConfig
    from deepinfer.model_executor.layers import moe as moe_layer
    from deepinfer.model_executor.layers.ep_moe import ep_routed_experts
    from deepinfer.model_executor.layers.kernel_table import KernelTable
    from tests.support.weight_reads import WeightReads
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        cfg = ModelConfig.from_dict(v41_tiny_config())
        n, k = cfg.n_routed_experts, cfg.n_experts_per_tok
        full = _moe(cfg, None, None, True)
        results = {}
        # (mode, rows per rank, this rank's expert ids): every pair goes to rank 0's experts
        cases = {"replicated": (True, torch.tensor([[0, 1], [2, 3], [1, 2]])),
                 "per_rank": (False, torch.tensor([[0, 1]]) if rank == 0 else torch.tensor([[2, 3]]))}
        for name, (replicated, idx) in cases.items():
            local = _moe(cfg, range(rank * n // 2, (rank + 1) * n // 2), dist.group.WORLD, replicated)
            table = KernelTable()
            calls = []
            active = table.moe_experts_active
            table.moe_experts_active = lambda *a: calls.append(1) or active(*a)
            gen = torch.Generator().manual_seed(100 if replicated else 100 + rank)
            x = torch.randn(idx.shape[0], cfg.hidden_size, generator=gen)
            w = torch.rand(idx.shape[0], k, generator=gen) + 0.1
            with WeightReads([local._w13, local._w2]) as reads:
                got = ep_routed_experts(local, x, idx, w, None, table, True)
            want = moe_layer.dense_local_experts(x, idx, w, full._w13, full._w2, cfg.swiglu_limit)
            results[name] = {"err": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                             "rows_read": sorted(reads.rows), "whole": reads.whole, "active_calls": len(calls)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_rank_without_hits_reads_no_expert_and_the_sum_is_one_ranks():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="deepinfer-ep-active-") as tmp:
        ctx = mp.start_processes(_child, args=(free_port(), tmp), nprocs=2, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=150):
                pass
        except Exception as e:
            errors = sorted(Path(tmp).glob("error.rank*.txt"))
            raise RuntimeError(errors[0].read_text() if errors else str(e)) from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    for name in ("replicated", "per_rank"):
        r0, r1 = ranks[0][name], ranks[1][name]
        for r in (r0, r1):
            assert r["err"] <= TOL * max(1.0, r["scale"]), (name, ranks)
            assert r["active_calls"] == 1 and not r["whole"], (name, r)
        assert r0["rows_read"] == [0, 1, 2, 3], (name, r0)      # every local expert hit
        assert r1["rows_read"] == [], (name, r1)                # no pair: no expert weight read

"""MultiRankExecutor: the engine's steps on a model spread over ranks (docs/architecture.md §8).

At start the driver (global rank 0, this process) fixes the KV pool every rank builds, opens the
store, spawns its host's other ranks (executor/local_ranks.py LocalRanks) and starts its own rank
(executor/rank_bootstrap.py); every other host's ranks come from `deepinfer follow`. Per step it runs
the driver's Worker under LocalRanks.guard, so a rank's death becomes a RankFailure naming it; the
Worker's runner publishes each step to the followers through its StepFanout transport.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import weakref

from deepinfer.distributed import launch
from deepinfer.executor.local_ranks import RENDEZVOUS_TIMEOUT_S, LocalRanks
from deepinfer.executor.rank_bootstrap import start_rank
from deepinfer.executor.rank_liveness import bound_collectives
from deepinfer.executor.step_fanout import StepFanout
from deepinfer.platforms import current_platform
from deepinfer.step_result import StepResult
from deepinfer.worker import cache_engine
from deepinfer.worker.worker import Worker, kv_pool_blocks, resolve_dtype

logger = logging.getLogger(__name__)


def fixed_pool_config(model_config, engine_config):
    """The engine config every rank runs: block size and KV pool size fixed by rank 0 (every rank's
    pool must have the driver's block ids), and a store port on a single host."""
    ec = engine_config
    dtype = resolve_dtype(ec.dtype, model_config)
    block = int(ec.block_size or cache_engine.default_block_size(model_config))
    blocks = kv_pool_blocks(ec, block, cache_engine.bytes_per_block(model_config, block, dtype, ec.kv_cache_mode))
    port = ec.master_port if ec.master_port is not None else launch.free_port(ec.master_addr)
    return dataclasses.replace(ec, block_size=block, num_kv_blocks=blocks, master_port=port)


class MultiRankExecutor:
    def __init__(self, ranks: LocalRanks, fanout: StepFanout, driver: Worker):
        self.ranks = ranks        # this host's follower processes, its ring, the watchdog
        self.fanout = fanout      # the driver runner's transport
        self.driver = driver
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def start(cls, model_config, engine_config, platform=None) -> "MultiRankExecutor":
        ec = engine_config
        if ec.node_rank != 0:
            raise ValueError(f"node_rank {ec.node_rank}: the engine runs on node 0; run `deepinfer follow` "
                             f"on the other hosts")
        import torch.distributed as dist
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group (another "
                               "multi-rank engine?): one per process; close the other engine first")
        platform = platform or current_platform()
        ec = fixed_pool_config(model_config, ec)
        store = launch.open_store(ec.master_addr, ec.master_port, True, RENDEZVOUS_TIMEOUT_S)
        store.set("deepinfer/config", json.dumps(dataclasses.asdict(ec)))
        store.set(launch.KEY_PLATFORM, json.dumps(platform.signature()))
        ranks = LocalRanks(ec, 0, store)
        try:
            ranks.spawn()
            rt = start_rank("driver", model_config, ec, platform, store, rank=0, local_rank=0,
                            check=ranks.raise_if_failed, ranks=ranks)
            ranks.wait_count(launch.KEY_READY, rt.layout.world_size - 1, "every rank to build its model")
        except BaseException:
            ranks.abort()
            raise
        # Past start-up (compiles are unbounded) a collective a hung rank never joins must end.
        groups = rt.groups
        bound_collectives([groups.cp, groups.lane, groups.ep, groups.dp_leaders, rt.host_group], ec.rank_step_timeout)
        layout = rt.layout
        logger.info("model on %d ranks (cp=%d, ep=%d, lanes of %d, %d host(s)); followers %s", layout.world_size,
                    layout.cp, layout.ep, layout.attn_tp, layout.nnodes, ranks.pids)
        return cls(ranks, rt.fanout, rt.worker)

    def execute(self, scheduled) -> StepResult:
        # a follower's death becomes a RankFailure naming it
        with self.ranks.guard():
            return self.driver.execute(scheduled)

    def watch_ranks(self, callback) -> None:
        self.ranks.add_listener(callback)

    def rank_failure(self):
        return self.ranks.failed

    def teardown(self) -> None:
        self.ranks.teardown()

    def close(self) -> None:
        """Stop the followers (a stop message when they are healthy) and release the process group and
        the ring; idempotent."""
        self.ranks.close(self.fanout)


def _close_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.close()

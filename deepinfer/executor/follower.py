"""A follower rank: `python -m deepinfer.executor.follower` (started by executor/local_ranks.py), and
the first rank of another host: `deepinfer follow` (docs/architecture.md §8).

A follower starts its rank (executor/rank_bootstrap.py: its device first, on Neuron its NeuronCore
before the runtime starts; the process group; its Worker with the driver's KV pool size; its host's
step ring) and then runs `StepFanout.follow`: every step the driver publishes, through the same
strategy forward, without sampling, until the driver's stop message. Whatever fails is written to the store under the
rank's key before the process exits, so the driver's error names the rank and carries the traceback.

Launched as a module (a fresh interpreter, like multiprocessing's spawn, but one that never re-imports
the launcher's `__main__`: an unguarded script or a server entry point stays safe).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback


def _parent_check(parent_pid: int):
    def check() -> None:
        if os.getppid() != parent_pid:
            raise SystemExit(f"the launcher (pid {parent_pid}) is gone")
    return check


def run_follower(rank: int, local_rank: int, parent_pid: int, config: dict) -> int:
    # A native crash (SIGSEGV, SIGABRT from glibc's heap checks, SIGBUS) prints every thread's Python
    # stack to stderr before the process dies: the driver's RankFailure names only the signal.
    faulthandler.enable()
    from deepinfer.distributed import launch
    launch.set_parent_death_signal()
    if os.getppid() != parent_pid:   # the launcher died before the signal was armed
        return 1
    from deepinfer.config import ModelConfig
    from deepinfer.engine_config import EngineConfig
    from deepinfer.platforms import current_platform

    ec = EngineConfig(**config)
    store = launch.open_store(ec.master_addr, ec.master_port, False, 600.0)
    check = _parent_check(parent_pid)
    try:
        from deepinfer.executor.rank_bootstrap import start_rank
        platform = current_platform()
        model_config = ModelConfig.from_pretrained(ec.model)
        ec.resolve(model_config)
        rt = start_rank("reader", model_config, ec, platform, store, rank=rank, local_rank=local_rank,
                        check=check)
        rt.fanout.follow(rt.worker.runner)
        rt.fanout.channel.ring.close()
    except BaseException:  # noqa: BLE001 - reported to the driver, then the process exits
        text = traceback.format_exc()
        sys.stderr.write(f"deepinfer rank {rank}: {text}")
        launch.report_error(store, rank, f"{text}")
        return 1
    finally:
        launch.destroy_process_group()
    return 0


def run_host(engine_config) -> int:
    """`deepinfer follow`: the first rank of host node_rank, and the launcher of that host's others."""
    faulthandler.enable()
    from deepinfer.config import ModelConfig
    from deepinfer.distributed import launch
    from deepinfer.engine_config import EngineConfig
    from deepinfer.executor.local_ranks import RENDEZVOUS_TIMEOUT_S, LocalRanks
    from deepinfer.executor.rank_bootstrap import start_rank
    from deepinfer.platforms import current_platform

    ec = engine_config
    if ec.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine (LLM or `deepinfer serve`); `deepinfer follow` is for "
                         "node_rank >= 1")
    store = launch.open_store(ec.master_addr, ec.master_port, False, RENDEZVOUS_TIMEOUT_S)
    rank = ec.node_rank * ec.parallel_layout(0).ranks_per_node
    ranks = None
    try:
        # the driver's config (its KV pool size above all), with this host's own paths
        driver = json.loads(store.get("deepinfer/config"))
        driver.update(model=ec.model, tokenizer=ec.tokenizer, node_rank=ec.node_rank)
        mine = EngineConfig(**driver)
        _check_same_world(ec, mine)
        model_config = ModelConfig.from_pretrained(mine.model)
        mine.resolve(model_config)
        ranks = LocalRanks(mine, ec.node_rank, store)

        def host_failed(failure) -> None:
            # on the watchdog thread: tell the driver (own store client), then take this host down
            client = launch.open_store(ec.master_addr, ec.master_port, False, 10.0)
            if failure.rank is not None and not client.check([launch.error_key(failure.rank)]):
                launch.report_error(client, failure.rank, f"rank {failure.rank} on host {ec.node_rank} {failure.cause}")
            os._exit(1)

        ranks.spawn(on_failure=host_failed)
        rt = start_rank("host_leader", model_config, mine, current_platform(), store, rank=rank, local_rank=0,
                        check=ranks.raise_if_failed, ranks=ranks)
        rt.fanout.follow(rt.worker.runner)
        ranks.close(None)   # the stop message went on to this host's ring with the others
    except BaseException:  # noqa: BLE001 - reported to the driver
        text = traceback.format_exc()
        sys.stderr.write(f"deepinfer rank {rank}: {text}")
        launch.report_error(store, rank, text)
        if ranks is not None:
            ranks.abort()
        launch.destroy_process_group()
        return 1
    return 0


def _check_same_world(mine, driver) -> None:
    for name in ("context_parallel_size", "expert_parallel_size", "attention_tp_size", "nnodes"):
        if getattr(mine, name) != getattr(driver, name):
            raise ValueError(f"{name}: this host says {getattr(mine, name)}, the driver {getattr(driver, name)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.executor.follower",
                                 description="one follower rank (started by the driver or `deepinfer follow`)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = ap.parse_args(argv)
    return run_follower(args.rank, args.local_rank, args.parent_pid, json.loads(args.config))


if __name__ == "__main__":
    raise SystemExit(main())

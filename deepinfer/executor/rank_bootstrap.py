"""One rank's start in a model spread over ranks, the same for its three roles (docs/architecture.md §8):

- "driver" (global rank 0, the engine process, executor/multi_rank.py) and "host_leader" (the first
  rank of another host, `deepinfer follow`, executor/follower.py run_host) started their host's other
  ranks (LocalRanks.spawn): they select device 0, wait until every rank selected its device, join the
  process group, build their Worker and create the host's step ring;
- "reader" (every other rank, executor/follower.py run_follower) selects its own device, joins the
  process group, builds its Worker and maps its host's ring.

Every rank's Worker gets a StepFanout (executor/step_fanout.py) as its runner's transport, over a
StepChannel of its role (distributed/step_channel.py). A rank other than the driver then counts
itself ready in the store; the driver waits for that count.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from deepinfer.distributed import launch
from deepinfer.distributed.shared_tables import SharedEngramTables
from deepinfer.distributed.step_channel import StepChannel
from deepinfer.distributed.step_ring import StepRing
from deepinfer.executor.local_ranks import LocalRanks, init_rank
from deepinfer.executor.step_fanout import StepFanout
from deepinfer.worker.worker import Worker


@dataclass
class RankRuntime:
    """What a started rank runs with."""
    layout: object          # distributed/parallel_layout.py ParallelLayout of this rank
    fanout: StepFanout      # the runner's transport
    worker: Worker
    groups: object          # distributed/groups.py ParallelGroups of this rank
    host_group: object      # the host-leaders group (None unless this rank leads a host of several)


def start_rank(role: str, model_config, engine_config, platform, store, *, rank: int, local_rank: int,
               check, ranks: LocalRanks | None = None) -> RankRuntime:
    """Start this process's rank (module docstring). ranks: the LocalRanks a driver or host leader
    spawned (None for a reader); check: raises to end a wait (a rank died, the launcher is gone)."""
    if (ranks is None) != (role == "reader"):
        raise ValueError(f"rank role {role!r}: the driver and host leaders start their host's ranks, readers do not")
    if role != "driver":
        check_platform(store, platform, rank)
    if ranks is not None:
        layout, groups, host_group = ranks.join(platform)
    else:
        platform.set_device(local_rank)   # before anything touches the device
        store.add(launch.KEY_DEVICE, 1)
        layout, groups, host_group = init_rank(engine_config, rank, local_rank, platform)
    channel = StepChannel(role, host_group=host_group, check=check)
    fanout = StepFanout(layout, groups, channel)
    # the host's shared Engram tables wait for the other local ranks: a rank's death ends the wait
    tables = SharedEngramTables.for_layout(layout, check=check) or False   # False: alone on its host
    worker = Worker(model_config, engine_config, rank=local_rank, parallel=groups, transport=fanout,
                    platform=platform, shared_tables=tables)
    if ranks is not None:
        ranks.attach_ring(channel, worker.runner.strategy, layout.dp)
    else:
        # the host's ring is created once every reader has counted itself here (LocalRanks.attach_ring)
        store.add(launch.ring_wanted_key(layout.node_rank), 1)
        channel.ring = _open_ring(store, layout.node_rank, local_rank - 1, check)
    if role != "driver":
        store.add(launch.KEY_READY, 1)
    return RankRuntime(layout, fanout, worker, groups, host_group)


def check_platform(store, platform, rank: int) -> None:
    """Raise unless this rank's platform signature is the driver's (launch.KEY_PLATFORM): ranks that
    disagree would build other graphs or weights and meet in mismatched collectives (a hang, or worse)."""
    driver = json.loads(store.get(launch.KEY_PLATFORM))
    mine = json.loads(json.dumps(platform.signature()))
    if mine != driver:
        diff = "; ".join(f"{k}: driver {driver.get(k)!r}, this rank {mine.get(k)!r}"
                         for k in sorted(set(driver) | set(mine)) if driver.get(k) != mine.get(k))
        raise RuntimeError(f"rank {rank} runs another platform setup than the driver ({diff}): give every "
                           f"rank the same DEEPINFER_* environment (docs/architecture.md §8)")


def _open_ring(store, node: int, reader_index: int, check) -> StepRing:
    """Map this host's ring (name and size from the store); the last reader to map it unlinks it."""
    key = launch.ring_key(node)
    while not store.check([key]):
        check()
        time.sleep(0.02)
    info = json.loads(store.get(key))
    ring = StepRing.open(info["name"], info["size"], reader_index)
    if store.add(launch.ring_mapped_key(node), 1) == ring.num_readers:
        ring.unlink()
    return ring

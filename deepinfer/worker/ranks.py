"""The processes of one model spread over ranks (docs/architecture.md §8).

The engine process is global rank 0, the driver. `start_worker` starts the other ranks of its host
(one process per device: per NeuronCore, or per CPU process in host mode), joins the process group
with them and returns the driver's Worker. Every other host runs `deepinfer follow` (worker/follower.py),
which does the same for its own ranks. `LocalRanks` is what both keep: their follower processes, the
host's step ring, and a watchdog thread over the processes.

Faults:
- a follower that dies (any signal or exit before shutdown) is seen by the watchdog within 0.1 s: it
  kills the host's other followers, so a driver blocked in a collective with them gets a gloo error
  at once; the step (Worker.execute under `guard`) then raises RankFailure naming the rank, and the
  driver tears the process group down (remote ranks waiting on it get errors and exit);
- a rank that fails to start (device, checkpoint, config) writes its traceback to the store: the
  driver's start fails with it;
- the launcher killed: every follower has PR_SET_PDEATHSIG = SIGKILL (it dies with the thread that
  started it; so start the engine in a thread that outlives it) and ring readers check their parent;
- close (LLMEngine.close, the server's shutdown, atexit) sends the followers a stop message, waits
  for them, kills stragglers and destroys the process group. The ring is unlinked as soon as every
  reader mapped it, so no exit path leaves a /dev/shm segment behind.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from deepinfer.distributed import launch
from deepinfer.distributed.follower_env import follower_environment
from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.step_channel import StepChannel
from deepinfer.distributed.step_ring import StepRing
from deepinfer.platforms import current_platform
from deepinfer.worker import cache_engine
from deepinfer.worker.step_fanout import StepFanout, slot_bytes
from deepinfer.worker.worker import Worker, kv_pool_blocks, resolve_dtype

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0   # every rank's device selected and the process group joined
RING_SLOTS = 4
_POLL_S = 0.1
_STOP_WAIT_S = 10.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class RankFailure(RuntimeError):
    """A rank of the model died or failed to start: the engine cannot run another step."""
    engine_dead = True


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def init_rank(engine_config, rank: int, local_rank: int, platform):
    """Join the process group as global rank `rank` (its device already selected): the rank's layout,
    its ParallelGroups and the host-leaders group (None unless this rank leads a host of several)."""
    layout = engine_config.parallel_layout(rank)
    launch.init_process_group(platform.dist_backend, rank, layout.world_size, engine_config.master_addr,
                              engine_config.master_port, RENDEZVOUS_TIMEOUT_S)
    groups = ParallelGroups.create(layout)
    host_group = launch.host_leaders_group(layout)
    return layout, groups, host_group


def fixed_pool_config(model_config, engine_config):
    """The engine config every rank runs: block size and KV pool size fixed by rank 0 (every rank's
    pool must have the driver's block ids), and a store port on a single host."""
    ec = engine_config
    dtype = resolve_dtype(ec.dtype, model_config)
    block = int(ec.block_size or cache_engine.default_block_size(model_config))
    blocks = kv_pool_blocks(ec, block, cache_engine.bytes_per_block(model_config, block, dtype, ec.kv_cache_mode))
    port = ec.master_port if ec.master_port is not None else launch.free_port(ec.master_addr)
    return dataclasses.replace(ec, block_size=block, num_kv_blocks=blocks, master_port=port)


class LocalRanks:
    def __init__(self, engine_config, node_rank: int, store):
        self.config = engine_config
        self.node_rank = node_rank
        self.store = store
        layout = engine_config.parallel_layout(0)
        self.world_size = layout.world_size
        self.per_node = layout.ranks_per_node
        self.first_rank = node_rank * self.per_node
        self.procs: dict[int, subprocess.Popen] = {}
        self.ring: StepRing | None = None
        self._deaths: list[tuple[int, int]] = []     # (rank, exit code) in the order seen
        self._lock = threading.Lock()
        self._closing = False
        self._failed: RankFailure | None = None
        self._on_failure = None
        self._watch: threading.Thread | None = None
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- start --------------------------------------------------------------------------------
    def spawn(self, on_failure=None) -> None:
        """Start this host's other ranks and the watchdog. on_failure(rank, code): called by the
        watchdog (on its thread) after it killed the other followers."""
        config = json.dumps(dataclasses.asdict(self.config))
        env = follower_environment(os.environ, _PACKAGE_ROOT)
        for local in range(1, self.per_node):
            rank = self.first_rank + local
            cmd = [sys.executable, "-m", "deepinfer.worker.follower", "--rank", str(rank),
                   "--local-rank", str(local), "--parent-pid", str(os.getpid()), "--config", config]
            self.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self._on_failure = on_failure
        self._watch = threading.Thread(target=self._watchdog, name="deepinfer-rank-watchdog", daemon=True)
        self._watch.start()

    def join(self, platform):
        """Select device 0 of this host, wait until every rank selected its device (a failure there
        ends the wait with its error), then join the process group."""
        platform.set_device(0)
        self.store.add(launch.KEY_DEVICE, 1)
        self.wait_count(launch.KEY_DEVICE, self.world_size, "every rank to select its device",
                        RENDEZVOUS_TIMEOUT_S)
        return init_rank(self.config, self.first_rank, 0, platform)

    def attach_ring(self, channel: StepChannel, strategy, dp: int) -> None:
        """Create this host's ring (sized by slot_bytes) for its readers and announce its name."""
        if self.per_node == 1:
            return
        self.ring = StepRing.create(RING_SLOTS, slot_bytes(strategy, self.config, dp), self.per_node - 1)
        self.store.set(launch.ring_key(self.node_rank), json.dumps({"name": self.ring.name, "size": self.ring.size}))
        channel.ring = self.ring

    def wait_count(self, key: str, target: int, what: str, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.store.add(key, 0) < target:
            self.raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailure(f"timed out after {timeout_s:.0f} s waiting for {what} "
                                  f"({self.store.add(key, 0)} of {target}); is every host's `deepinfer follow` running?")
            time.sleep(0.05)

    # -- faults -------------------------------------------------------------------------------
    def _watchdog(self) -> None:
        while True:
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or any(r == rank for r, _ in self._deaths):
                    continue
                with self._lock:
                    self._deaths.append((rank, code))
                    first = len(self._deaths) == 1 and not self._closing
                if first:
                    logger.error("rank %d (pid %d) %s", rank, proc.pid, _exit_text(code))
                    self.kill_all()
                    if self._on_failure is not None:
                        self._on_failure(rank, code)
            with self._lock:
                if self._closing and all(p.poll() is not None for p in self.procs.values()):
                    return
            time.sleep(_POLL_S)

    def _reported(self) -> dict[int, str]:
        """Errors ranks left in the store (rank -> text)."""
        out = {}
        try:
            if self.store.add(launch.KEY_ERRORS, 0) == 0:
                return out
            for rank in range(self.world_size):
                if self.store.check([launch.error_key(rank)]):
                    out[rank] = self.store.get(launch.error_key(rank)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store went down with the driver
            pass
        return out

    def failure(self) -> RankFailure | None:
        """The first failure, preferring a death by signal, then an error that is not a peer's
        connection closing (those follow from the first), then any. Main thread only (store)."""
        if self._failed is not None:
            return self._failed
        with self._lock:
            deaths = list(self._deaths)
        reported = self._reported()
        if not deaths and not reported:
            return None
        candidates = []
        for rank, code in deaths:
            text = reported.get(rank)
            prio = 0 if code < 0 else (1 if text and "onnection closed" not in text else 2)
            msg = f"rank {rank} (pid {self.procs[rank].pid}) {_exit_text(code)}"
            candidates.append((prio, msg + (f":\n{text}" if text else "")))
        for rank, text in reported.items():
            if rank not in self.procs:
                prio = 1 if "onnection closed" not in text else 2
                candidates.append((prio, f"rank {rank} failed:\n{text}"))
        candidates.sort(key=lambda c: c[0])
        self._failed = RankFailure(f"a rank of the model failed: {candidates[0][1]}")
        return self._failed

    def raise_if_failed(self) -> None:
        failure = self.failure()
        if failure is not None:
            raise failure

    @contextlib.contextmanager
    def guard(self):
        """Run one step; a collective that broke because a rank died becomes that rank's RankFailure."""
        self.raise_if_failed()
        try:
            yield
        except RankFailure:
            self.teardown()
            raise
        except RuntimeError as e:   # gloo / the device backend: a peer went away
            failure = self._await_failure(5.0)
            if failure is None:
                raise
            self.teardown()
            raise failure from e

    def _await_failure(self, timeout_s: float) -> RankFailure | None:
        deadline = time.monotonic() + timeout_s
        while True:
            failure = self.failure()
            if failure is not None or time.monotonic() > deadline:
                return failure
            time.sleep(0.05)

    # -- stop ---------------------------------------------------------------------------------
    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _reap(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if any(p.poll() is None for p in self.procs.values()):
            logger.warning("followers did not stop within %.0f s: killing them", timeout_s)
            self.kill_all()
            for proc in self.procs.values():
                proc.wait()

    def teardown(self) -> None:
        """After a failure: no follower, no process group, no ring."""
        with self._lock:
            self._closing = True
        self.kill_all()
        self._reap(_STOP_WAIT_S)
        launch.destroy_process_group()
        if self.ring is not None:
            self.ring.close()

    def close(self, fanout: StepFanout | None = None) -> None:
        """Stop the followers (told through the ring when they are healthy), then release everything."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            healthy = not self._deaths and self._failed is None
        if healthy and fanout is not None and self.procs_alive():
            try:
                fanout.shutdown()
            except Exception:  # noqa: BLE001 - a follower died meanwhile: kill what is left
                logger.exception("could not send the stop message")
        self._reap(_STOP_WAIT_S)
        launch.destroy_process_group()
        if self.ring is not None:
            self.ring.close()

    def abort(self) -> None:
        self.teardown()

    def procs_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}


def _close_at_exit(ref) -> None:
    ranks = ref()
    if ranks is not None:
        ranks.close(getattr(ranks, "fanout", None))


def start_worker(model_config, engine_config, platform=None) -> Worker:
    """The engine's Worker: on one rank a plain Worker; on several, the driver's, with its host's
    followers started and every rank's model built."""
    ec = engine_config
    if ec.world_size == 1:
        return Worker(model_config, ec, platform=platform)
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
    ranks = LocalRanks(ec, 0, store)
    try:
        ranks.spawn()
        layout, groups, host_group = ranks.join(platform)
        channel = StepChannel("driver", host_group=host_group, check=ranks.raise_if_failed)
        fanout = StepFanout(layout, groups, channel)
        worker = Worker(model_config, ec, rank=0, parallel=groups, fanout=fanout, platform=platform)
        ranks.attach_ring(channel, worker.runner.strategy, layout.dp)
        ranks.wait_count(launch.KEY_READY, layout.world_size - 1, "every rank to build its model")
    except BaseException:
        ranks.abort()
        raise
    ranks.fanout = fanout
    worker.ranks = ranks
    logger.info("model on %d ranks (cp=%d, ep=%d, lanes of %d, %d host(s)); followers %s", layout.world_size,
                layout.cp, layout.ep, layout.attn_tp, layout.nnodes, ranks.pids)
    return worker

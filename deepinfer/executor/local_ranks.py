"""The processes of one host of a model spread over ranks (docs/architecture.md §8).

The engine process is global rank 0, the driver: its executor (executor/multi_rank.py) starts the
other ranks of its host (one process per device: per NeuronCore, or per CPU process in host mode),
joins the process group with them and builds the driver's Worker (executor/rank_bootstrap.py). Every
other host runs `deepinfer follow` (executor/follower.py), which does the same for its own ranks.
`LocalRanks` is what both keep: their follower processes, the host's step ring, and a watchdog
thread over the processes.

Faults:
- a follower that dies (any signal or exit before shutdown) is seen by the watchdog within 0.1 s,
  whether or not a step runs; so is another host whose link to the driver closes
  (distributed/host_links.py), an error a remote rank leaves in the store, and a step older than
  rank_step_timeout (the follower it waits on is named hung: executor/rank_liveness.py). The watchdog
  records the RankFailure, kills the host's other followers (so a driver blocked in a collective with
  them gets a gloo error at once), tells other hosts to stop (KEY_STOP) and calls the listeners
  (LLMEngine.watch_ranks: the server's engine thread). The step (MultiRankExecutor.execute under `guard`) raises
  that RankFailure, and the driver tears the process group down (remote ranks waiting on it get
  errors and exit);
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

from deepinfer.distributed import host_links, launch
from deepinfer.distributed.follower_env import follower_environment
from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.step_channel import StepChannel
from deepinfer.distributed.step_ring import StepRing
from deepinfer.executor.rank_liveness import StepClock, exit_text, silent_follower
from deepinfer.executor.step_fanout import StepFanout, slot_bytes

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0   # every rank's device selected and the process group joined
RING_SLOTS = 4
_POLL_S = 0.1
_STOP_WAIT_S = 10.0
_WATCH_STORE_TIMEOUT_S = 10.0   # the watchdog's store connect
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
KEY_STOP = "deepinfer/stop"   # set by the driver's watchdog on a failure: every other host stops its ranks


class RankFailure(RuntimeError):
    """A rank of the model died, hung or failed to start: the engine cannot run another step.
    rank: the global rank it names (None when none is known); cause: what happened to it, in words."""
    engine_dead = True

    def __init__(self, message: str, rank: int | None = None, cause: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.cause = cause


def init_rank(engine_config, rank: int, local_rank: int, platform):
    """Join the process group as global rank `rank` (its device already selected): the rank's layout,
    its ParallelGroups and the host-leaders group (None unless this rank leads a host of several)."""
    layout = engine_config.parallel_layout(rank)
    launch.init_process_group(platform.dist_backend, rank, layout.world_size, engine_config.master_addr,
                              engine_config.master_port, RENDEZVOUS_TIMEOUT_S)
    groups = ParallelGroups.create(layout)
    host_group = launch.host_leaders_group(layout)
    return layout, groups, host_group


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
        self._listeners: list = []
        self._announced = False
        self._host_links: host_links.HostLinks | None = None   # the driver of several hosts: one per host
        self._link = None   # another host: its connection to the driver's HostLinks
        self._watch: threading.Thread | None = None
        self.step_clock = StepClock()
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- start --------------------------------------------------------------------------------
    def spawn(self, on_failure=None) -> None:
        """Start this host's other ranks and the watchdog. on_failure(RankFailure): called by the
        watchdog (on its thread) after it killed the other followers (as `add_listener`)."""
        config = json.dumps(dataclasses.asdict(self.config))
        env = follower_environment(os.environ, _PACKAGE_ROOT)
        for local in range(1, self.per_node):
            rank = self.first_rank + local
            cmd = [sys.executable, "-m", "deepinfer.executor.follower", "--rank", str(rank),
                   "--local-rank", str(local), "--parent-pid", str(os.getpid()), "--config", config]
            self.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        if on_failure is not None:
            self._listeners.append(on_failure)
        if self.node_rank == 0 and self.config.nnodes > 1:
            self._host_links = host_links.HostLinks(self.config.master_addr)
            self.store.set(host_links.KEY_HOST_LINKS, str(self._host_links.port))
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
        """Create this host's ring (sized by slot_bytes) for its readers and announce its name, once
        every reader has built its model and waits for it: a launcher killed before then (a start-up
        stopped by hand, the OOM killer while a follower loads) leaves no segment in /dev/shm, and the
        readers map the new ring at once (the last one unlinks it, distributed/step_ring.py)."""
        if self.per_node == 1:
            return
        self.wait_count(launch.ring_wanted_key(self.node_rank), self.per_node - 1,
                        "every rank of this host to build its model")
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
    def add_listener(self, callback) -> None:
        """callback(RankFailure) on the watchdog thread when a rank is lost (at once, on this thread,
        when one already is); it must not block."""
        with self._lock:
            self._listeners.append(callback)
            failed = self._failed
        if failed is not None:
            callback(failed)

    @property
    def failed(self) -> RankFailure | None:
        """The failure the watchdog (or a step) recorded; any thread, no store round trip."""
        return self._failed

    def _watchdog(self) -> None:
        """Every _POLL_S, step or no step: a follower that ended; on the driver of several hosts, a host
        whose link closed (distributed/host_links.py) or an error a remote rank left in the store; on
        another host, the driver's stop word; a step the followers leave unanswered for longer than
        rank_step_timeout. The first of these kills this host's followers and tells the listeners."""
        store = self._watch_store()
        driver = self.node_rank == 0
        remote = driver and self.config.nnodes > 1 and store is not None
        if not driver and store is not None:
            self._connect_link(store)
        timeout = float(getattr(self.config, "rank_step_timeout", 0) or 0)
        while True:
            new = [(rank, proc.returncode) for rank, proc in list(self.procs.items())
                   if proc.poll() is not None and all(r != rank for r, _ in self._deaths)]
            lost_hosts = self._host_links.lost() if self._host_links is not None else []
            with self._lock:
                self._deaths += new
                watching = not self._closing and not self._announced
            if watching:
                failure = self._failed   # a step's thread may have recorded it first
                if failure is None and (new or remote):
                    failure = self._settle(self._reported(store) if store is not None else {})
                if failure is None and lost_hosts:
                    failure = self._host_failure(lost_hosts[0])
                if failure is None and not driver and store is not None and _stop_word(store):
                    failure = self._record(RankFailure("the driver stopped the model (a rank failed)"))
                if failure is None:
                    took = self.step_clock.overdue(timeout)
                    if took is not None:
                        failure = self._hang_failure(took, timeout)
                if failure is not None:
                    self._fail(failure, store)
            with self._lock:
                if self._closing and all(p.poll() is not None for p in self.procs.values()):
                    return
            time.sleep(_POLL_S)

    def _connect_link(self, store) -> None:
        """Another host: hold a connection to the driver, so its death is seen at once there."""
        try:
            port = int(store.get(host_links.KEY_HOST_LINKS))
            self._link = host_links.connect(self.config.master_addr, port, self.node_rank)
        except Exception:  # noqa: BLE001 - the driver still sees this host's errors through the store
            logger.exception("could not open this host's link to the driver")

    def _watch_store(self):
        """The watchdog's own store client (a client is not shared across threads): what a follower
        that exited left there names the failure. None when it cannot connect."""
        try:
            return launch.open_store(self.config.master_addr, self.config.master_port, False,
                                     _WATCH_STORE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the store is gone: the followers' exits still count
            logger.exception("the rank watchdog could not connect to the store")
            return None

    def _hang_failure(self, took: float, timeout: float) -> RankFailure | None:
        lagging = self.ring.lagging_readers() if self.ring is not None else []
        # with other hosts, a local follower that read the step and runs may only be waiting for them
        named = silent_follower(self.procs, lagging, self.first_rank, guess=self.config.nnodes == 1)
        if named is None:
            if self.config.nnodes == 1:
                return None
            cause = f"hung: no answer to a step within {timeout:g} s from a rank on another host"
            return self._record(RankFailure(f"a rank of the model failed: {cause}; the other hosts were told to "
                                            f"stop after {took:.1f} s", None, cause))
        rank, why = named
        cause = f"did not answer a step within {timeout:g} s ({why})"
        return self._record(RankFailure(f"a rank of the model failed: rank {rank} (pid {self.procs[rank].pid}) "
                                        f"hung: {cause}; killed after {took:.1f} s", rank, f"hung: {cause}"))

    def _host_failure(self, node: int) -> RankFailure:
        rank = node * self.per_node
        cause = "its host's link to the driver closed (the process died, or the host is unreachable)"
        return self._record(RankFailure(f"a rank of the model failed: rank {rank} (`deepinfer follow` on host "
                                        f"{node}) is gone: {cause}", rank, cause))

    def _record(self, failure: RankFailure) -> RankFailure:
        """The first failure recorded wins; returns it."""
        with self._lock:
            if self._failed is None:
                self._failed = failure
            return self._failed

    def _fail(self, failure: RankFailure, store) -> None:
        """Announce the failure once: log it, kill this host's followers, tell the other hosts (the
        driver) and the listeners."""
        with self._lock:
            if self._announced:
                return
            self._announced = True
            listeners = list(self._listeners)
        logger.error("%s", f"{failure}".splitlines()[0])
        self.kill_all()
        if self._host_links is not None and store is not None:
            try:
                store.set(KEY_STOP, f"{failure}".splitlines()[0])
            except Exception:  # noqa: BLE001 - the other hosts still see the process group go
                pass
        for callback in listeners:
            try:
                callback(failure)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the watchdog
                logger.exception("rank failure listener failed")

    def _reported(self, store=None) -> dict[int, str]:
        """Errors ranks left in the store (rank -> text)."""
        store = self.store if store is None else store
        out = {}
        try:
            if store.add(launch.KEY_ERRORS, 0) == 0:
                return out
            for rank in range(self.world_size):
                if store.check([launch.error_key(rank)]):
                    out[rank] = store.get(launch.error_key(rank)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store went down with the driver
            pass
        return out

    def failure(self) -> RankFailure | None:
        """The first failure, preferring a hang the watchdog named, then a death by signal, then an
        error that is not a peer's connection closing (those follow from the first), then any.
        Calls the store: the thread that owns self.store only (the watchdog has its own)."""
        if self._failed is not None:
            return self._failed
        return self._settle(self._reported())

    def _settle(self, reported: dict[int, str]) -> RankFailure | None:
        with self._lock:
            if self._failed is None:
                self._failed = self._first_failure(list(self._deaths), reported)
            return self._failed

    def _first_failure(self, deaths, reported) -> RankFailure | None:
        candidates = []
        for rank, code in deaths:
            text = reported.get(rank)
            prio = 0 if code < 0 else (1 if text and "onnection closed" not in text else 2)
            cause = exit_text(code)
            msg = f"rank {rank} (pid {self.procs[rank].pid}) {cause}"
            candidates.append((prio, rank, cause, msg + (f":\n{text}" if text else "")))
        for rank, text in reported.items():
            if rank not in self.procs:
                prio = 1 if "onnection closed" not in text else 2
                lines = text.strip().splitlines()
                candidates.append((prio, rank, lines[-1] if lines else "failed", f"rank {rank} failed:\n{text}"))
        if not candidates:
            return None
        _, rank, cause, msg = min(candidates, key=lambda c: c[0])   # the first seen of the best kind
        return RankFailure(f"a rank of the model failed: {msg}", rank, cause)

    def raise_if_failed(self) -> None:
        failure = self.failure()
        if failure is not None:
            raise failure

    @contextlib.contextmanager
    def guard(self):
        """Run one step; a collective that broke because a rank died (or was killed for hanging)
        becomes that rank's RankFailure. The step clock runs meanwhile (the watchdog's hang check)."""
        try:
            self.raise_if_failed()
            self.step_clock.begin()
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
        finally:
            self.step_clock.end()

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
        """After a failure: announced (when the step's thread saw it first), then no follower, no
        process group, no ring."""
        if self._failed is not None:
            self._fail(self._failed, self.store)
        with self._lock:
            self._closing = True
        self.kill_all()
        self._reap(_STOP_WAIT_S)
        self._release()

    def _release(self) -> None:
        self._join_watchdog()
        launch.destroy_process_group()
        if self.ring is not None:
            self.ring.close()
        if self._host_links is not None:
            self._host_links.close()
        if self._link is not None:
            self._link.close()

    def _join_watchdog(self) -> None:
        """Wait for the watchdog to return (it does once closing and every follower reaped): a daemon
        thread still inside the store client's connect when the interpreter exits aborts the process
        ("terminate called without an active exception"). Bounded by the connect timeout
        (_watch_store) and a poll; not from the watchdog's own thread (its listeners may close)."""
        watch = self._watch
        if watch is not None and watch is not threading.current_thread():
            watch.join(timeout=_WATCH_STORE_TIMEOUT_S + 2 * _POLL_S)
            if watch.is_alive():
                logger.warning("the rank watchdog did not stop within %.1f s", _WATCH_STORE_TIMEOUT_S)

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
        self._release()

    def abort(self) -> None:
        self.teardown()

    def procs_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}


def _stop_word(store) -> bool:
    try:
        return store.check([KEY_STOP])
    except Exception:  # noqa: BLE001 - the store went down with the driver: the process group ends us
        return False


def _close_at_exit(ref) -> None:
    # The driver's executor closes first, with its stop message (executor/multi_rank.py registers
    # its own exit hook later, so it runs earlier); this one only releases what is left.
    ranks = ref()
    if ranks is not None:
        ranks.close()

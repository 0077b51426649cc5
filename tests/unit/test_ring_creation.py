"""When the launcher creates its host's step ring (executor/local_ranks.py attach_ring): only once every
reader of the host has built its model and waits for it, so a launcher killed while a follower still
loads (for minutes, on a full-size model) leaves no segment in /dev/shm."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from deepinfer.distributed import launch
from deepinfer.distributed.step_channel import StepChannel
from deepinfer.distributed.step_ring import our_segments
from deepinfer.engine_config import EngineConfig
from deepinfer.executor import local_ranks as ranks_module


def test_the_ring_waits_for_every_reader_to_build_its_model(monkeypatch):
    monkeypatch.setattr(ranks_module, "slot_bytes", lambda strategy, config, dp: 4096)
    store = dist.HashStore()
    ranks = ranks_module.LocalRanks(EngineConfig(model="unused", context_parallel_size=3), 0, store)
    channel = StepChannel("driver")
    before = set(our_segments())
    errors = []

    def attach():
        try:
            ranks.attach_ring(channel, None, 1)
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            errors.append(e)

    thread = threading.Thread(target=attach, daemon=True)
    thread.start()
    try:
        store.add(launch.ring_wanted_key(0), 1)   # one of the two readers is ready
        time.sleep(0.5)
        assert thread.is_alive() and set(our_segments()) == before, "the ring exists before its readers"
        store.add(launch.ring_wanted_key(0), 1)   # the second one
        thread.join(10)
        assert not thread.is_alive() and not errors, errors
        assert channel.ring is ranks.ring and ranks.ring.num_readers == 2
        assert ranks.ring.name in our_segments()
        assert store.get(launch.ring_key(0))
    finally:
        if ranks.ring is not None:
            ranks.ring.close()
        with ranks._lock:
            ranks._closing = True
    assert set(our_segments()) == before

"""StepChannel: how each step message reaches every rank (docs/neuron.md §5.7).

On one host the driver writes the host's StepRing and the other ranks read it. With several hosts the
driver also broadcasts the message (its size, then its bytes, over a gloo group of the hosts' first
ranks: step metadata travels on the host network, not the device fabric); each host's first rank
receives it and writes its own host's ring for the ranks there.

Roles: "driver" (global rank 0: sends), "host_leader" (first rank of another host: receives by
broadcast, re-publishes on its ring), "reader" (every other rank: reads its host's ring).
"""
from __future__ import annotations

import torch

from deepinfer.distributed.step_codec import StepMessage, encode, to_bytes
from deepinfer.distributed.step_ring import StepRing

ROLES = ("driver", "host_leader", "reader")


class StepChannel:
    def __init__(self, role: str, ring: StepRing | None = None, host_group=None, check=None):
        """check: called while a send or a read waits (it raises to stop the wait: a rank died)."""
        if role not in ROLES:
            raise ValueError(f"step channel role: one of {ROLES}, got {role!r}")
        self.role = role
        self.ring = ring          # may be attached after construction (it is sized once the model exists)
        self.host_group = host_group
        self.check = check

    def send(self, msg: StepMessage) -> None:
        if self.role != "driver":
            raise RuntimeError("only the driver sends steps")
        if self.host_group is None:
            if self.ring is not None:
                size, parts = encode(msg)
                self.ring.write(size, parts, check=self.check)
            return
        payload = to_bytes(msg)
        if self.ring is not None:
            self.ring.write(len(payload), [(0, memoryview(payload))], check=self.check)
        _broadcast(self.host_group, payload)

    def receive(self) -> bytearray:
        if self.role == "reader":
            return self.ring.read(check=self.check)
        if self.role == "host_leader":
            payload = _broadcast(self.host_group, None)
            if self.ring is not None:
                self.ring.write(len(payload), [(0, memoryview(payload))], check=self.check)
            return payload
        raise RuntimeError("the driver does not receive steps")


def _broadcast(group, payload: bytearray | None) -> bytearray:
    """Global rank 0's payload on every member of `group` (gloo, host tensors)."""
    import torch.distributed as dist
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if payload is not None:
        dist.broadcast(torch.frombuffer(payload, dtype=torch.uint8), src=0, group=group)
        return payload
    buf = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return bytearray(buf.numpy().tobytes())

"""Rendezvous of the ranks of one model (docs/architecture.md §8): the store, the torch.distributed
process group and the keys the ranks exchange.

Global rank 0 (the engine process, the driver) creates the TCP store on master_addr:master_port before
it starts anything, so every other process can report through it from its first line (a follower
whose device or checkpoint fails says why there, and the driver fails its start with that text). The
process group then rendezvouses with `init_method="env://"` on the same port: torch reuses the
driver's store server (multi-tenant) instead of opening a second one.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket

# Store keys (one namespace per run: a store lives as long as its driver).
KEY_DEVICE = "deepinfer/device"          # counter: ranks whose device is selected
KEY_READY = "deepinfer/ready"            # counter: ranks whose Worker is built
KEY_ERRORS = "deepinfer/num_errors"      # counter: ranks that reported an error
KEY_PLATFORM = "deepinfer/platform"      # the driver's Platform.signature() as JSON


def error_key(rank: int) -> str:
    return f"deepinfer/error/{rank}"


def ring_key(node: int) -> str:
    return f"deepinfer/ring/{node}"


def ring_mapped_key(node: int) -> str:
    return f"deepinfer/ring/{node}/mapped"


def ring_wanted_key(node: int) -> str:
    """Counter: readers of host `node` that built their model and wait for its ring."""
    return f"deepinfer/ring/{node}/wanted"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when the thread that started it exits
    (prctl PR_SET_PDEATHSIG): a follower never outlives its launcher, even a SIGKILLed one."""
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def open_store(addr: str, port: int, is_master: bool, timeout_s: float):
    import torch.distributed as dist
    return dist.TCPStore(addr, port, is_master=is_master, wait_for_workers=False, multi_tenant=True,
                         timeout=datetime.timedelta(seconds=timeout_s))


def report_error(store, rank: int, text: str) -> None:
    """Leave `text` for the driver (best effort: the store may be gone with it)."""
    try:
        store.set(error_key(rank), text[-4000:])
        store.add(KEY_ERRORS, 1)
    except Exception:  # noqa: BLE001 - the driver is gone; nobody is left to tell
        pass


def init_process_group(backend: str, rank: int, world_size: int, addr: str, port: int,
                       timeout_s: float) -> None:
    """torch.distributed.init_process_group with env:// rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE).
    timeout_s bounds the rendezvous and the default group's operations; the model's groups keep
    torch's default timeout (a first Neuron compile may hold a collective for minutes)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def host_leaders_group(layout):
    """The gloo group of every host's first rank (the step broadcast), or None on one host. Every rank
    must call this, after ParallelGroups.create, in the same order."""
    import torch.distributed as dist
    if layout.nnodes == 1:
        return None
    ranks = [n * layout.ranks_per_node for n in range(layout.nnodes)]
    group = dist.new_group(ranks, backend="gloo")
    return group if layout.rank in ranks else None


def destroy_process_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - tearing down after a peer died: nothing left to release
            pass

"""Engram tables once per host, in shared memory (docs/neuron.md §5.9).

V4.1-Flash's two Engram tables are about 12.7 GB packed: one copy per rank would cost every rank more
than its weights. So the ranks of one host share one copy:

1. once every local rank has reached this point (counted in the torch.distributed store), the host's
   lowest local rank (the creator) creates one /dev/shm segment per table (the packed e4m3 codes and
   their ue8m0 exponents, or the dense table), sized from the model, and publishes its name through
   the store. The name holds a random per-run token and names the creator (distributed/shm_owner.py:
   its pid and start time; the others never derive it from a pid, a follower does not share its
   parent's);
2. every other local rank opens the segment (its size checked against the model's), maps it read-only
   and counts itself in the store; a rank that cannot (its model differs: another platform or weight
   format) says so in the store, and the creator, polling for the count, fails at once with its reason
   instead of waiting out its timeout;
3. once all local ranks have mapped it, the creator unlinks it: from then on nothing of ours is in
   /dev/shm, whichever process dies later, and the memory goes when the last mapping does. The table
   is filled only after that (through the creator's writable mapping), so the window in which a
   killed creator leaves a segment behind is the few milliseconds of step 2: not the checkpoint read,
   and not the wait for ranks still loading (step 1 comes first); the next creator on the host removes
   such a leftover (shm_owner.sweep_stale);
4. the creator publishes "filled" (or the error that stopped it); every rank's Engram host table
   (layers/engram_host.py) is then a view of the mapping (torch.frombuffer: no copy, read-only pages,
   so a stray in-place write faults instead of corrupting the other ranks' table). The tables are no
   part of the module tree, so `model.to(device)` leaves them here: each step's rows are gathered
   from the mapping on the host and only they travel to the device.

A single rank on its host (ParallelLayout.ranks_per_node == 1) shares nothing: `for_layout` returns
None and the loader reads the tables as any other tensor.

Hooked into loading by `worker.build_model`, which makes one whenever its `parallel` groups put
several ranks on the host (or takes `shared_tables=`): the loader skips the table tensors (`names`),
`attach` maps (and on the creator fills) them before the platform's byte layout is applied to the
other fp8 weights; the creator applies it to the tables as it fills them.
"""
from __future__ import annotations

import mmap
import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from deepinfer.distributed import shm_owner

SHM_DIR = shm_owner.SHM_DIR
SEGMENT_PREFIX = "deepinfer-engram-"
_ALIGN = 64            # every part of a segment starts on a cache line (and any dtype's alignment)
_FILLED = b"filled"
_FAILED = "!"          # a store value starting with this is the creator's error, not a segment name
# Every rank attaches its tables once per model it builds, in the same order, so the count of this
# rank's attaches *in this store* names each attach's keys alike on every rank (a second model on the
# same store gets new keys). Counted in the store, not per process: an engine's followers are fresh
# processes (executor/local_ranks.py) while its driver may have built models before, each with its own store.


@dataclass(frozen=True)
class TablePart:
    """One tensor of a table's segment: its state_dict name, shape, dtype and byte offset."""
    name: str
    shape: tuple
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TableLayout:
    """The segment of one Engram table: `module` is the table module's path (`layers.1.engram.embed`)."""
    module: str
    parts: tuple[TablePart, ...]

    @property
    def nbytes(self) -> int:
        last = self.parts[-1]
        return last.offset + last.nbytes


def table_layouts(model: nn.Module) -> list[TableLayout]:
    """The Engram tables of a built model (meta is fine): a PackedFp8Table's codes then exponents,
    or a dense table's one tensor, in layer order."""
    from deepinfer.model_executor.layers.engram_host import host_tables
    out = []
    for path, mod in host_tables(model).items():
        parts, offset = [], 0
        for leaf, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            part = TablePart(f"{path}.{leaf}", tuple(t.shape), t.dtype, offset)
            parts.append(part)
            offset = -(-(offset + part.nbytes) // _ALIGN) * _ALIGN
        out.append(TableLayout(path, tuple(parts)))
    return out


def table_bytes(model: nn.Module) -> int:
    """Bytes of all Engram tables of a model: what one host holds once in shared memory."""
    return sum(t.nbytes for t in table_layouts(model))


def _default_store():
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


def _ro_views(mm: mmap.mmap, table: TableLayout) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        # a read-only buffer: torch warns that it cannot mark the tensor read-only; the pages are
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _views(mm, table)


def _views(mm: mmap.mmap, table: TableLayout) -> dict[str, torch.Tensor]:
    return {p.name: torch.frombuffer(mm, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
            .view(p.dtype).view(p.shape) for p in table.parts}


class SharedEngramTables:
    """The Engram tables of one rank, mapped from its host's shared memory (see the module docstring).

    layout: the rank's ParallelLayout (node_rank, local_rank, ranks_per_node); store: the
    torch.distributed store every rank of the world shares (default: the default group's);
    timeout_s: how long a rank waits for the others (a rank that never maps fails the creator); the
    default leaves room for ranks that reach `attach` minutes apart after loading their own weights.
    The other ranks wait twice as long for a segment name (so the creator's own timeout reaches them
    as its error, not as theirs) and `fill_timeout_s` for the fill (the creator reads the tables
    from the checkpoint meanwhile). check: called while waiting, raises to end the wait (an engine's
    rank watchdog saw a rank die: executor/rank_bootstrap.py passes LocalRanks.raise_if_failed)."""

    def __init__(self, layout, store=None, timeout_s: float = 900.0, fill_timeout_s: float = 3600.0,
                 check=None):
        if layout.ranks_per_node < 2:
            raise ValueError("SharedEngramTables: one rank on its host has nothing to share "
                             "(use SharedEngramTables.for_layout, which returns None then)")
        self.layout = layout
        self.store = store if store is not None else _default_store()
        self.timeout_s = float(timeout_s)
        self.check = check or (lambda: None)
        self.fill_timeout_s = float(fill_timeout_s)
        self.segment_names: dict[str, str] = {}   # table module -> segment name (kept for reports and tests)
        self._mappings: list[mmap.mmap] = []
        self._shared_ptrs: set[int] = set()

    @classmethod
    def for_layout(cls, layout, store=None, timeout_s: float = 900.0, check=None) -> "SharedEngramTables | None":
        return cls(layout, store, timeout_s, check=check) if layout.ranks_per_node > 1 else None

    @property
    def is_creator(self) -> bool:
        return self.layout.local_rank == 0

    def _key(self, table: TableLayout, what: str) -> str:
        return f"deepinfer/engram_tables/{self._attach_id}/node{self.layout.node_rank}/{table.module}/{what}"

    def names(self, model: nn.Module) -> set[str]:
        """state_dict names the loader must skip: every Engram table tensor."""
        return {p.name for t in table_layouts(model) for p in t.parts}

    def attach(self, model: nn.Module, model_dir, platform=None) -> int:
        """Map every Engram table of `model` (still meta from loading with `names` skipped) from shared
        memory and bind the module tensors to the mapping; the creator fills the segments from
        `model_dir`, in the platform's fp8 byte layout (Platform.fp8_weight_codes). Returns the bytes
        mapped."""
        tables = table_layouts(model)
        if not tables:
            return 0
        self._attach_id = self.store.add(f"deepinfer/engram_tables/attaches/rank{self.layout.rank}", 1) - 1
        if self.is_creator:
            views = self._create(tables, model_dir, platform)
        else:
            views = self._open(tables)
        self._shared_ptrs |= {t.data_ptr() for t in views.values()}
        for table in tables:
            mod = model.get_submodule(table.module)
            for part in table.parts:
                leaf = part.name.rsplit(".", 1)[1]
                t = views[part.name]
                if leaf in mod._parameters:
                    mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
                else:
                    mod._buffers[leaf] = t
        return sum(t.nbytes for t in tables)

    def keep_shared(self, convert):
        """`convert` (Platform.fp8_weight_codes) for model.map_fp8_codes, leaving the mapped tables as
        they are: the creator wrote them in the platform's layout already, and a converted copy would
        be one private table per rank again."""
        mapped = set(self._shared_ptrs)

        def apply(codes, scale):
            if codes.data_ptr() in mapped:
                return codes, scale
            return convert(codes, scale)
        return apply

    # -- creator ------------------------------------------------------------------------------------
    def _create(self, tables: list[TableLayout], model_dir, platform) -> dict[str, torch.Tensor]:
        fds, paths = {}, {}
        others = self.layout.ranks_per_node - 1
        try:
            # create nothing until every local rank is here to map at once: a rank still loading (or
            # dead) must not stretch the window in which a killed creator would leave segments behind
            self._wait_count(self._ready_key(), others, "reached the Engram tables")
            shm_owner.sweep_stale(SEGMENT_PREFIX, shm_dir=SHM_DIR)
            token = shm_owner.owned_name(SEGMENT_PREFIX)
            for i, table in enumerate(tables):
                name = f"{token}-n{self.layout.node_rank}-{i}"
                path = os.path.join(SHM_DIR, name)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fds[table.module], paths[table.module] = fd, path
                os.ftruncate(fd, table.nbytes)
                self.segment_names[table.module] = name
                self.store.set(self._key(table, "name"), name)
            for table in tables:
                self._wait_count(self._key(table, "mapped"), others,
                                 f"mapped the shared segment of Engram table {table.module}")
        except BaseException as e:
            for table in tables:
                if table.module not in self.segment_names:   # the others wait for a name: tell them
                    self.store.set(self._key(table, "name"), f"{_FAILED}{e}")
                self.store.set(self._key(table, "filled"), f"error: {e}".encode())
            raise
        finally:
            for path in paths.values():
                _unlink_quietly(path)
        try:
            ro = {}
            for table in tables:
                fd = fds[table.module]
                self._fill(fd, table, model_dir, platform)
                mm = mmap.mmap(fd, table.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
                self._mappings.append(mm)
                ro.update(_ro_views(mm, table))
        except BaseException as e:
            for table in tables:
                self.store.set(self._key(table, "filled"), f"error: {e}".encode())
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        for table in tables:
            self.store.set(self._key(table, "filled"), _FILLED)
        return ro

    def _ready_key(self) -> str:
        return f"deepinfer/engram_tables/{self._attach_id}/node{self.layout.node_rank}/ready"

    def _failed_key(self) -> str:
        """Set by a local rank whose mapping failed (a size mismatch: its model differs from the creator's)."""
        return f"deepinfer/engram_tables/{self._attach_id}/node{self.layout.node_rank}/failed"

    def _wait_count(self, key: str, want: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            got = self.store.add(key, 0)
            if got >= want:
                return
            if self.store.check([self._failed_key()]):
                raise RuntimeError(f"Engram tables of node {self.layout.node_rank}: "
                                   f"{self.store.get(self._failed_key()).decode()}")
            self.check()   # a rank that died without a word (killed) ends the wait through its watchdog
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {got} of the {want} other local ranks of node {self.layout.node_rank} "
                                   f"{what} within {self.timeout_s:.0f} s")
            time.sleep(0.01)

    def _fill(self, fd: int, table: TableLayout, model_dir, platform) -> None:
        from deepinfer.model_executor.loader import load_weights
        expected = {p.name: (p.shape, p.dtype) for p in table.parts}
        values = load_weights(model_dir, expected, dtype=None, progress=False, partial=True)
        if platform is not None and len(table.parts) == 2:   # packed: codes, exponents
            codes, scale = (values[p.name] for p in table.parts)
            codes, scale = platform.fp8_weight_codes(codes, scale)
            values = {table.parts[0].name: codes, table.parts[1].name: scale}
        mm = mmap.mmap(fd, table.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            for name, view in _views(mm, table).items():
                src = values[name]
                if tuple(src.shape) != tuple(view.shape) or src.dtype != view.dtype:
                    raise ValueError(f"{name}: the checkpoint gives {tuple(src.shape)} {src.dtype}, the shared "
                                     f"segment holds {tuple(view.shape)} {view.dtype}")
                view.copy_(src)
                del view
        finally:
            del values
            mm.close()   # the views above are gone; the read-only mapping is made next

    # -- other local ranks ----------------------------------------------------------------------------
    def _open(self, tables: list[TableLayout]) -> dict[str, torch.Tensor]:
        wait = timedelta(seconds=2 * self.timeout_s)
        fill_wait = timedelta(seconds=self.fill_timeout_s)
        ro = {}
        self.store.add(self._ready_key(), 1)
        try:
            return self._map(tables, wait, fill_wait, ro)
        except BaseException as e:
            # the creator waits for this rank to map: tell it at once instead of letting it time out
            self.store.set(self._failed_key(), f"local rank {self.layout.local_rank}: {e}".encode())
            raise

    def _map(self, tables: list[TableLayout], wait: timedelta, fill_wait: timedelta, ro: dict) -> dict:
        for table in tables:
            name = self._get(self._key(table, "name"), wait, table, "publish its segment").decode()
            if name.startswith(_FAILED):
                raise RuntimeError(f"Engram table {table.module}: the creating rank (local rank 0 of node "
                                   f"{self.layout.node_rank}) failed: {name[len(_FAILED):]}")
            if not name.startswith(SEGMENT_PREFIX) or "/" in name:
                raise RuntimeError(f"Engram table {table.module}: the store names segment {name!r}, not one of ours")
            self.segment_names[table.module] = name
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            except FileNotFoundError:   # unlinked already: the creator gave up waiting for the ranks
                state = self._get(self._key(table, "filled"), fill_wait, table, "fill its segment").decode()
                raise RuntimeError(f"Engram table {table.module}: segment {name} is gone; the creating rank "
                                   f"(local rank 0 of node {self.layout.node_rank}) failed: {state}") from None
            try:
                size = os.fstat(fd).st_size
                if size != table.nbytes:
                    raise RuntimeError(f"Engram table {table.module}: shared segment {name} holds {size} bytes, "
                                       f"this rank's model needs {table.nbytes} (the ranks built different models: "
                                       f"every rank must run the same platform, dtype and weight format)")
                mm = mmap.mmap(fd, table.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            self._mappings.append(mm)
            ro.update(_ro_views(mm, table))
            self.store.add(self._key(table, "mapped"), 1)
        for table in tables:
            state = self._get(self._key(table, "filled"), fill_wait, table, "fill its segment")
            if state != _FILLED:
                raise RuntimeError(f"Engram table {table.module}: the creating rank (local rank 0 of node "
                                   f"{self.layout.node_rank}) failed: {state.decode()}")
        return ro

    def _get(self, key: str, wait: timedelta, table: TableLayout, what: str) -> bytes:
        deadline = time.monotonic() + wait.total_seconds()
        while not self.store.check([key]):   # polled, so that `check` can end the wait
            if time.monotonic() > deadline:
                raise RuntimeError(f"Engram table {table.module}: the creating rank (local rank 0 of node "
                                   f"{self.layout.node_rank}) did not {what} within {wait.total_seconds():.0f} s")
            self.check()
            # up to an hour (the fill) for up to 63 ranks of a host: a coarser poll than the creator's
            time.sleep(0.05)
        return self.store.get(key)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""StepRing: a single-writer, many-reader ring of fixed-size slots in /dev/shm (docs/neuron.md §5.7).

The driver (or, on another host, that host's first rank) writes each step's message; the other ranks
of the host read every message in order. Layout of the segment:

    header page: magic | num_slots | slot_size | num_readers | consumed[num_readers] (u64 each)
    slot i:      seq u64 | length u64 | payload (slot_size bytes)

Message n (from 1) goes to slot (n - 1) % num_slots. The writer fills the payload and the length, and
writes seq last; a reader waits for its slot's seq to equal n, copies the payload out, then marks n
consumed. The writer waits until every reader has consumed n - num_slots before reusing a slot, so a
slow reader holds the writer back instead of losing a step. "seq written last" publishes the slot
because x86 (TSO) makes stores visible in program order; a host with a weaker memory model would need
a fence between the payload and the seq.

The segment's name is random and names its creator (shm_owner.owned_name: the pid and the process's
start time; readers find it through the torch.distributed store, never from a pid, since a spawned
child does not share its parent's); `open` asserts the size and geometry it finds. The
segment is reserved with posix_fallocate, so a /dev/shm too small for it fails at creation, not with
a SIGBUS mid-run. The launcher creates it only once every reader has built its model and waits for it
(executor/local_ranks.py attach_ring), and the last reader to map it unlinks it (counted through the
store): a crash can leave it behind only in the moment between the two, and the next ring created on
the host removes such a leftover (shm_owner.sweep_stale).
"""
from __future__ import annotations

import mmap
import os
import struct
import time

from deepinfer.distributed import shm_owner

SHM_DIR = shm_owner.SHM_DIR
NAME_PREFIX = "deepinfer-ring-"
_MAGIC = 0x3130474E49524944  # "DIRING01"
_HEADER = 4096
_SLOT_HEAD = 16
_U64 = struct.Struct("<Q")
_GEOMETRY = struct.Struct("<QQQQ")
_CONSUMED = 64            # offset of consumed[] in the header page
MAX_READERS = (_HEADER - _CONSUMED) // 8


class RingClosed(RuntimeError):
    """The wait for a slot was stopped by its `check` callback or by a deadline."""


def _slot_stride(slot_size: int) -> int:
    return -(-(slot_size + _SLOT_HEAD) // 4096) * 4096


def segment_size(num_slots: int, slot_size: int) -> int:
    return _HEADER + num_slots * _slot_stride(slot_size)


def our_segments() -> list[str]:
    """Names of the ring segments in /dev/shm (tests assert none is left behind)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []


class StepRing:
    def __init__(self, name: str, fd: int, size: int, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mm = mmap.mmap(fd, size)
        os.close(fd)
        magic, self.num_slots, self.slot_size, self.num_readers = _GEOMETRY.unpack_from(self._mm, 0)
        if not owner and magic != _MAGIC:
            self._mm.close()
            raise RuntimeError(f"step ring {name}: not a deepinfer ring (magic {magic:#x})")
        self._stride = _slot_stride(self.slot_size)
        self._next = 1            # next sequence number to write (writer) or read (reader)
        self.reader_index: int | None = None

    # -- lifetime --------------------------------------------------------------------------
    @classmethod
    def create(cls, num_slots: int, slot_size: int, num_readers: int) -> "StepRing":
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"step ring: 1 to {MAX_READERS} readers, got {num_readers}")
        if num_slots < 2 or slot_size < 64:
            raise ValueError(f"step ring: needs >= 2 slots of >= 64 bytes, got {num_slots} x {slot_size}")
        shm_owner.sweep_stale(NAME_PREFIX, shm_dir=SHM_DIR)
        name = shm_owner.owned_name(NAME_PREFIX)
        size = segment_size(num_slots, slot_size)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise RuntimeError(f"step ring: cannot reserve {size} bytes in {SHM_DIR} ({e}); the ring needs "
                               f"{num_slots} slots of {slot_size} bytes (raise the container's --shm-size)") from None
        ring = cls(name, fd, size, owner=True)
        _GEOMETRY.pack_into(ring._mm, 0, _MAGIC, num_slots, slot_size, num_readers)
        ring.num_slots, ring.slot_size, ring.num_readers = num_slots, slot_size, num_readers
        ring._stride = _slot_stride(slot_size)
        return ring

    @classmethod
    def open(cls, name: str, expected_size: int, reader_index: int) -> "StepRing":
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ValueError(f"step ring: bad segment name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        size = os.fstat(fd).st_size
        if size != expected_size:
            os.close(fd)
            raise RuntimeError(f"step ring {name}: segment has {size} bytes, the driver announced {expected_size}")
        ring = cls(name, fd, size, owner=False)
        if segment_size(ring.num_slots, ring.slot_size) != size or not 0 <= reader_index < ring.num_readers:
            ring.close()
            raise RuntimeError(f"step ring {name}: geometry {ring.num_slots} x {ring.slot_size} for "
                               f"{ring.num_readers} readers does not match (reader {reader_index}, {size} bytes)")
        ring.reader_index = reader_index
        return ring

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); a no-op once it is gone."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.owner:
            self.unlink()
        if not self._mm.closed:
            self._mm.close()

    # -- data ------------------------------------------------------------------------------
    def _slot(self, seq: int) -> int:
        return _HEADER + ((seq - 1) % self.num_slots) * self._stride

    def _consumed(self, reader: int) -> int:
        return _U64.unpack_from(self._mm, _CONSUMED + 8 * reader)[0]

    def write(self, size: int, parts, check=None, timeout_s: float | None = None) -> int:
        """Publish one message given as (offset, bytes) parts of `size` bytes; returns its sequence number."""
        if size > self.slot_size:
            raise ValueError(f"step ring: a {size}-byte step message does not fit the {self.slot_size}-byte "
                             f"slots (sized from max_num_batched_tokens, max_model_len and max_num_seqs)")
        seq = self._next
        oldest = seq - self.num_slots
        if oldest > 0:
            _wait(lambda: min(self._consumed(r) for r in range(self.num_readers)) >= oldest, check, timeout_s,
                  "a reader to free a slot")
        base = self._slot(seq)
        payload = base + _SLOT_HEAD
        for off, view in parts:
            self._mm[payload + off:payload + off + len(view)] = view
        _U64.pack_into(self._mm, base + 8, size)
        _U64.pack_into(self._mm, base, seq)      # last: publishes the slot
        self._next = seq + 1
        return seq

    def lagging_readers(self) -> list[int]:
        """Indices of the readers that have not consumed the last message written (writer side; safe
        from another thread: it only reads the header)."""
        last = self._next - 1
        if last < 1 or self._mm.closed:
            return []
        return [r for r in range(self.num_readers) if self._consumed(r) < last]

    def read(self, check=None, timeout_s: float | None = None) -> bytearray:
        """The next message (a private copy), waiting for it."""
        seq, base = self._next, self._slot(self._next)
        _wait(lambda: _U64.unpack_from(self._mm, base)[0] == seq, check, timeout_s, f"step {seq}")
        size = _U64.unpack_from(self._mm, base + 8)[0]
        out = bytearray(self._mm[base + _SLOT_HEAD:base + _SLOT_HEAD + size])
        _U64.pack_into(self._mm, _CONSUMED + 8 * self.reader_index, seq)
        self._next = seq + 1
        return out


def _wait(ready, check, timeout_s, what: str) -> None:
    """Poll `ready` with a growing sleep (spinning would take the cores the ranks compute on);
    `check` runs every ~50 ms and may raise to stop the wait."""
    if ready():
        return
    start = last_check = time.monotonic()
    delay = 0.0
    while not ready():
        time.sleep(delay)
        # 20 us at first (a decode step's publication is due any moment), up to 2 ms when idle
        delay = min(2e-3, max(2e-5, delay * 1.5))
        now = time.monotonic()
        if now - last_check > 0.05:
            last_check = now
            if check is not None:
                check()
            if timeout_s is not None and now - start > timeout_s:
                raise RingClosed(f"step ring: timed out after {timeout_s:.0f} s waiting for {what}")

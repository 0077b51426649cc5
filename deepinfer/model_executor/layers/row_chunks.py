"""Row chunks that bound the per-row intermediates of a many-row step (docs/neuron.md §4 B7).

A prompt chunk's indexer and attention make tensors of [rows, visible entries or gathered keys,
width] per step: at V4.1-Flash shapes (a 2048-token chunk, 16K context) one such tensor is 16 GiB.
Every op involved is row-wise (each row's scores, top-k, softmax and gathered records depend only
on that row), so running the rows in chunks gives every row the same result and bounds each
intermediate by the chunk's. Chunk sizes depend only on shapes, so a traced graph stays static.

A prompt chunk's rows do not gather per row at all: they read the shared scope, what the chunk's
last row sees, gathered once (forward_meta.CompressMeta.scope_idx); the chunks still bound their
[rows, scope] score tensors. `scope_branch` picks, per chunk, the scope or the rows' own gathers.
That scope covers one sequence, because a graph's inputs have fixed shapes; an eager step with
several prompt chunks (a batch of prompts) gives every chunk its own scope instead (`scope_chunks`,
forward_meta.StepInputs.seq_scopes), so no prompt row gathers per row. A row of chunk s sees a
prefix of what s's last row sees, so each way gives every row the same bits.
"""
import torch

# Largest intermediate one chunk may make: half the 256 MiB a graph's largest intermediate may
# reach (tests/unit/test_intermediates.py), leaving room for the chunk's neighbours.
CHUNK_BYTES = 128 << 20


def row_chunks(rows: int, bytes_per_row: int, budget: int | None = None) -> list[tuple[int, int]]:
    """[start, end) ranges covering `rows`, each a power of two of rows (the last one shorter) whose
    intermediates of `bytes_per_row` a row stay within `budget` (default CHUNK_BYTES); one range
    when all rows fit."""
    per = max(1, (budget or CHUNK_BYTES) // max(1, bytes_per_row))
    n = 1 << (per.bit_length() - 1)
    if n >= rows:
        return [(0, rows)]
    return [(s, min(rows, s + n)) for s in range(0, rows, n)]


def scope_branch(in_scope: torch.Tensor, shared, own, args: tuple, part: str = "") -> tuple:
    """shared(*args) when every row of a chunk belongs to the step's scope sequence (`in_scope`, [rows]
    bool), else own(*args): both give such rows the same result, the shared one reading the scope
    gathered once (forward_meta.CompressMeta.scope_idx), the own one each row's gathered entries.
    Traced into a graph it is a torch.cond (no host sync, both branches compiled); on meta (the
    full-scale intermediates reports) both branches run, since the graph holds both. `part` names
    the caller ("indexer", "attention") for tools that pick a branch (tools/scope_gathers.py)."""
    if torch.compiler.is_compiling():
        return torch.cond(in_scope.all(), shared, own, args)
    if in_scope.is_meta:
        own(*args)
        return shared(*args)
    return shared(*args) if bool(in_scope.all()) else own(*args)


def scope_chunks(rows: int, scoped_row_bytes: int, own_row_bytes: int,
                 scopes: tuple) -> list[tuple[int, int, int | None]]:
    """(start, end, scope row) ranges covering `rows` in order for an eager step with per-sequence
    scopes (`scopes`: the [start, end) rows of each prompt chunk): a range inside a chunk's rows
    carries that chunk's last row, whose visible entries are the range's scope; a range between
    them (decode rows) carries None and reads its rows' own gathers. Ranges are row_chunks of their
    run, by the bytes a row makes either way."""
    out: list[tuple[int, int, int | None]] = []

    def run(a: int, b: int, last: int | None) -> None:
        size = own_row_bytes if last is None else scoped_row_bytes
        out.extend((a + s, a + e, last) for s, e in row_chunks(b - a, size))
    at = 0
    for a, b in scopes:
        if at < a:
            run(at, a, None)
        run(a, b, b - 1)
        at = b
    if at < rows:
        run(at, rows, None)
    return out

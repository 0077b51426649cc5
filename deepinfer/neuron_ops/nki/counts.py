"""Calls of the NKI kernel wrappers since the process started, by kernel-table name (no torch here:
`deepinfer.neuron_ops.nki.simulation_counts` must be importable without the kernels)."""
from collections import Counter

_CALLS: Counter = Counter()


def record(name: str) -> None:
    _CALLS[name] += 1


def simulation_counts() -> dict[str, int]:
    """{kernel name: calls} of every NKI kernel run since the process started (a copy)."""
    return dict(_CALLS)

"""The environment a follower rank's process starts with (docs/neuron.md §2.3, §5.7).

A follower inherits the launcher's environment with two changes: the package root goes first on
PYTHONPATH (a follower runs `python -m deepinfer.executor.follower` from any working directory), and
the Neuron runtime's profiler switches (`NEURON_RT_INSPECT_*`) are left out. Those name one output
directory, so with them every rank of a host would write its profile over the others'; the driver
keeps them and profiles for the group.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

DRIVER_ONLY_PREFIXES = ("NEURON_RT_INSPECT_",)


def driver_only(name: str) -> bool:
    return name.startswith(DRIVER_ONLY_PREFIXES)


def follower_environment(parent: Mapping[str, str], package_root: str) -> dict[str, str]:
    """A copy of `parent` for a follower's process: driver-only variables removed, `package_root`
    prepended to PYTHONPATH."""
    env = {k: v for k, v in parent.items() if not driver_only(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, parent.get("PYTHONPATH")) if p)
    return env

"""What a Neuron step runs outside its compiled regions (docs/neuron.md §4 C1, C4, D3).

On a device every eager aten op is its own NEFF launch, and every host<->device copy drains the
stream. `OpCensus` is a TorchDispatchMode the Neuron runner (worker/runners/neuron_regions.py) holds
active around a step's device work (inputs copy, forward, draft block, draft heads) and pops around
each compiled region call (`paused`), so it sees exactly the aten ops that would run eagerly:

- eager ops: every aten op outside a region except views (`OpOverload.is_view`: slicing, expand,
  reshape-as-view, detach; they change metadata only and launch nothing), each with its call site;
- views: counted apart;
- host->device copies: tensors the runner hands to the device (`to_device`: the packed step buffer,
  model_executor/step_pack.py), counted by the runner at that boundary (in host mode the copy is a
  no-op, so the count is of what a device would copy);
- device->host copies: tensors the runner hands back (the logits; a draft block's rows), counted at
  that boundary, plus every scalar read of a tensor during the step (`aten._local_scalar_dense`:
  item / tolist / bool of a tensor), which on a device is a blocking copy.

`StepCensus` is one engine step: the main forward and any draft work that follows it.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

EAGER_OPS_TARGET = 10   # eager aten ops a decode step may run outside its regions (plain or speculative)
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))


@dataclass
class StepCensus:
    """One engine step's eager work: `label` says which forward opened it (bucket and step class)."""
    label: str
    eager_ops: Counter = field(default_factory=Counter)     # (op, call site, phase) -> count
    views: int = 0
    host_to_device: int = 0
    device_to_host: int = 0
    phases: list = field(default_factory=list)               # "step", "draft", "heads" in order
    by_phase: dict = field(default_factory=dict)             # phase -> Counter of eager_ops / copies

    @property
    def num_eager_ops(self) -> int:
        return sum(self.eager_ops.values())

    def to_dict(self) -> dict:
        return {"label": self.label, "eager_ops": self.num_eager_ops, "views": self.views,
                "host_to_device_copies": self.host_to_device, "device_to_host_copies": self.device_to_host,
                "phases": list(self.phases), "by_phase": {p: dict(c) for p, c in self.by_phase.items()},
                "ops": {f"{phase}: {op} at {site}": n for (op, site, phase), n in sorted(self.eager_ops.items())}}


def call_site() -> str:
    """The innermost frame outside torch and this file, as path:line (function)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR) or "/contextlib.py" in path:
            continue
        return f"{os.path.relpath(path, _ROOT)}:{frame.lineno} ({frame.name})"
    return "?"


class OpCensus(TorchDispatchMode):
    """The eager ops and copies of each engine step (module docstring); `steps` holds one StepCensus
    a step, in order."""

    def __init__(self):
        super().__init__()
        self.steps: list[StepCensus] = []

    @property
    def current(self) -> StepCensus | None:
        return self.steps[-1] if self.steps else None

    def open_step(self, label: str) -> StepCensus:
        self.steps.append(StepCensus(label))
        return self.steps[-1]

    def phase(self, name: str) -> None:
        if self.current is None:
            self.open_step(name)
        self.current.phases.append(name)

    def _tally(self, key: str, n: int = 1) -> None:
        step = self.current
        phase = step.phases[-1] if step.phases else "step"
        step.by_phase.setdefault(phase, Counter())[key] += n

    def host_to_device(self, n: int = 1) -> None:
        self.current.host_to_device += n
        self._tally("host_to_device", n)

    def device_to_host(self, n: int = 1) -> None:
        self.current.device_to_host += n
        self._tally("device_to_host", n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        step = self.current
        if step is not None:
            if func is _SCALAR_READ:
                self.device_to_host(1)
            elif func.is_view:
                step.views += 1
            else:
                phase = step.phases[-1] if step.phases else "step"
                step.eager_ops[(str(func.overloadpacket.__name__), call_site(), phase)] += 1
                self._tally("eager_ops")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self):
        """This mode popped for a compiled region call (its ops run inside the region's graph)."""
        with _pop_mode_temporarily():
            yield

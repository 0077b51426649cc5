"""Skip Dynamo's non-tensor guards on steps whose shape has run clean before.

Every call of a compiled region first evaluates its guards: the shapes, strides and dtypes of every
tensor it reads (the layer's weights included) and every Python value the trace read (module
attributes, the step layout's constants, dict keys). On the cpu platform's compiled decode step that
was 100-140 us a call, 15 calls a plain step, about 2 ms of a 12 ms batch-1 step (torch.profiler,
"TorchDynamo Cache Lookup"; README "Compiled CPU decode step").

torch's `skip_guard_eval_unsafe` stance evaluates only the guards that tell a code object's cache
entries apart (its tensor guards, and any guard that has failed before) and skips the rest. That is
safe when a call's Python values cannot differ from those of the entry it matches, and unsafe when
one can: a value no earlier call varied, then changed, would run a graph traced for the old value.
The region runner's graphs take every per-step value as a tensor of the packed step buffer and every
constant from the step's bucket and layout (neuron_regions.py), so this class skips only on a step
whose key, the bucket and layout it runs, has already run `clean_runs` times with every guard
evaluated and no graph compiled. A step that compiles (a guard failed) starts its key's count again.
Where a region call under the stance would have to recompile (a tensor guard failed), torch refuses
before running anything and the call runs again with every guard (neuron_ops/regions.call_region);
such a step is logged, and its key goes back to full guards for good.

Measured (16 held-out prompts of the trained V4.1, 16 tokens each, one thread, compiled, the setting
off and on alternated three times each in one process; the same tokens): 4.01 -> 3.56 s at nextn 0,
3.04 -> 2.91 s at nextn 3 (medians).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator

import torch

logger = logging.getLogger(__name__)


class WarmGuards:
    def __init__(self, graphs: Callable[[], int], enabled: bool, clean_runs: int = 2):
        """graphs: the number of region graphs compiled so far (a step that compiles raised it)."""
        self._graphs, self.enabled, self.clean_runs = graphs, enabled, clean_runs
        self._clean: dict[Hashable, int] = {}
        self.always_guarded: set[Hashable] = set()   # keys that compiled while skipping
        self.skipped_steps = 0

    @contextlib.contextmanager
    def step(self, key: Hashable | None) -> Iterator[None]:
        """Run one step under key (None: a step with no bucket, always fully guarded)."""
        skip = (self.enabled and key is not None and key not in self.always_guarded
                and self._clean.get(key, 0) >= self.clean_runs)
        before = self._graphs()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext():
            yield
        if key is None:
            return
        if self._graphs() == before:
            self._clean[key] = self._clean.get(key, 0) + 1
            self.skipped_steps += skip
            return
        self._clean[key] = 0
        if skip:
            self.always_guarded.add(key)
            logger.warning("a step compiled region graphs while skipping warm guards (key %s): its steps run "
                           "with every guard from now on (worker/runners/warm_guards.py)", key)

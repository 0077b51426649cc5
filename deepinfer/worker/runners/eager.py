"""EagerStrategy: the step runs as the scheduler built it, no buckets, no graphs (cpu platform,
enforce_eager, and the reference the static strategies are tested against)."""
from __future__ import annotations

import torch

from deepinfer.model_executor.forward_meta import StepInputs
from deepinfer.model_executor.static_step import Bucket
from deepinfer.worker.runners.base import RunnerStrategy


class EagerStrategy(RunnerStrategy):
    name = "eager"

    def forward(self, step: StepInputs, cache, bucket: Bucket | None) -> torch.Tensor:
        forward_argmax = getattr(self.model, "forward_argmax", None)
        if forward_argmax is None:
            return self.model(step, cache)
        logits, self.row_argmax = forward_argmax(step, cache)   # RunnerStrategy.row_argmax
        return logits

"""What the engine (engine/llm_engine.py) drives: an executor runs each scheduled step on every rank
of the model and returns the driver's StepResult.

- SingleRankExecutor (executor/single_rank.py): the model on this process's device alone;
- MultiRankExecutor (executor/multi_rank.py): the model spread over ranks (context and expert
  parallelism), this process its driver.
Both hold the driver's Worker (worker/worker.py), whose pool sizes the engine's block manager uses.
"""
from __future__ import annotations

from typing import Protocol

from deepinfer.step_result import StepResult


class Executor(Protocol):
    driver: object  # the rank-0 Worker: num_kv_blocks, block_size, num_state_slots, runner

    def execute(self, scheduled) -> StepResult:
        """One step of the scheduled rows (engine/scheduler.py ScheduledSeq)."""

    def close(self) -> None:
        """Release the model's processes; idempotent. No step runs after this."""

    def watch_ranks(self, callback) -> None:
        """callback(RankFailure) on the watchdog thread once a rank is lost (never on one rank)."""

    def rank_failure(self):
        """The RankFailure of a lost rank, None while every rank runs (always None on one rank)."""

    def teardown(self) -> None:
        """Kill what is left of the ranks after a failure (nothing on one rank)."""


def build_executor(model_config, engine_config, platform=None) -> Executor:
    """The executor engine_config asks for: several ranks when world_size > 1."""
    if engine_config.world_size == 1:
        from deepinfer.executor.single_rank import SingleRankExecutor
        from deepinfer.worker.worker import Worker
        return SingleRankExecutor(Worker(model_config, engine_config, platform=platform))
    from deepinfer.executor.multi_rank import MultiRankExecutor
    return MultiRankExecutor.start(model_config, engine_config, platform)

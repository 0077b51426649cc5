"""SingleRankExecutor: the model on this process's device alone; a step is the Worker's."""
from __future__ import annotations

from deepinfer.step_result import StepResult


class SingleRankExecutor:
    def __init__(self, driver):
        """driver: a Worker (worker/worker.py), or anything with its execute / pool sizes (tests)."""
        self.driver = driver

    def execute(self, scheduled) -> StepResult:
        return self.driver.execute(scheduled)

    def close(self) -> None:
        pass

    # One process: no rank to lose.
    def watch_ranks(self, callback) -> None:
        pass

    def rank_failure(self):
        return None

    def teardown(self) -> None:
        pass

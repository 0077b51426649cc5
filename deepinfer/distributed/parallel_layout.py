"""Where a rank sits among the ranks that run one model (pure arithmetic, no process group).

world = max(cp, ep) ranks, numbered so that every group is a run of consecutive ranks:

- CP group (context_parallel_size consecutive ranks): one replicated batch; the driver (rank 0)
  schedules and samples, the others follow. With ep > cp there are dp = world / cp CP groups
  (data-parallel attention): each runs its own share of the step's rows.
- lane (attention_tp_size consecutive ranks inside a CP group): attention heads are sharded in a
  lane and replicated across lanes; the lane all-reduces the attention output.
- EP group (expert_parallel_size consecutive ranks): routed experts are sharded over it. When it
  lies inside one CP group the tokens are already replicated (one all-reduce); when it spans CP
  groups the tokens are dispatched by all-gather and combined by reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    rank: int = 0
    cp: int = 1        # context_parallel_size
    ep: int = 1        # expert_parallel_size
    attn_tp: int = 1   # attention_tp_size (lane size)
    nnodes: int = 1    # hosts; each runs world_size / nnodes consecutive ranks

    def __post_init__(self):
        for name in ("cp", "ep", "attn_tp", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        big, small = max(self.cp, self.ep), min(self.cp, self.ep)
        if big % small:
            raise ValueError(f"context_parallel_size ({self.cp}) and expert_parallel_size ({self.ep}): "
                             f"the larger must be a multiple of the smaller")
        if self.cp % self.attn_tp:
            raise ValueError(f"attention_tp_size ({self.attn_tp}) must divide context_parallel_size ({self.cp})")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.nnodes} nodes cannot split a world of {self.world_size} ranks evenly")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return max(self.cp, self.ep)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- hosts -------------------------------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_rank(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """Index of this rank on its host (its NeuronCore there)."""
        return self.rank % self.ranks_per_node

    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    # -- CP / data-parallel attention groups ------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        """Which CP group (share of the step's rows) this rank runs."""
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    def cp_ranks(self, dp_rank: int | None = None) -> list[int]:
        g = self.dp_rank if dp_rank is None else dp_rank
        return list(range(g * self.cp, (g + 1) * self.cp))

    def dp_leaders(self) -> list[int]:
        """The first rank of every CP group (they hand their rows' logits to the driver)."""
        return [g * self.cp for g in range(self.dp)]

    # -- attention lanes ----------------------------------------------------------------------
    @property
    def lane_rank(self) -> int:
        return self.cp_rank % self.attn_tp

    def lane_ranks(self) -> list[int]:
        first = self.rank - self.lane_rank
        return list(range(first, first + self.attn_tp))

    # -- expert parallelism ---------------------------------------------------------------------
    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def ep_ranks(self) -> list[int]:
        first = self.rank - self.ep_rank
        return list(range(first, first + self.ep))

    @property
    def tokens_replicated_in_ep(self) -> bool:
        """The EP group lies inside one CP group: every member holds the same tokens."""
        return self.ep <= self.cp

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, in one fixed order (torch.distributed.new_group must be called
        by every rank for every group, in the same order)."""
        w = self.world_size
        return {
            "cp": [list(range(s, s + self.cp)) for s in range(0, w, self.cp)],
            "lane": [list(range(s, s + self.attn_tp)) for s in range(0, w, self.attn_tp)],
            "ep": [list(range(s, s + self.ep)) for s in range(0, w, self.ep)],
            "dp_leaders": [self.dp_leaders()],
        }

    def check_model(self, cfg) -> None:
        """Raise ValueError when the model cannot be split this way."""
        if cfg.num_heads % self.attn_tp:
            raise ValueError(f"attention_tp_size {self.attn_tp} must divide num_heads {cfg.num_heads}")
        experts = [("n_routed_experts", cfg.n_routed_experts)]
        if getattr(cfg, "is_v41", False) and getattr(cfg, "num_nextn_predict_layers", 0):
            experts.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts))
        for name, n in experts:
            if n % self.ep:
                raise ValueError(f"expert_parallel_size {self.ep} must divide {name} ({n})")

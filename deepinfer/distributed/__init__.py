"""Ranks of one model across devices: the layout of the ranks (parallel_layout.py), their process
groups (groups.py) and the collectives the model calls (comm.py). See docs/architecture.md."""

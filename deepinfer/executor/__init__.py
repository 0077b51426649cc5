"""Between the engine and the workers: how a step reaches every rank of the model.

base.py the Executor the engine drives and `build_executor`; single_rank.py one rank; multi_rank.py
a model spread over ranks (the driver's side); local_ranks.py a host's follower processes, the
watchdog and RankFailure; rank_bootstrap.py one rank's start, for the driver, a host leader and a
reader alike; follower.py the follower entry points (`python -m deepinfer.executor.follower`,
`deepinfer follow`); step_fanout.py the multi-rank transport of the ModelRunner (worker/step_transport.py).
"""

"""The `deepinfer` console script: `deepinfer serve --model PATH ...` (like `vllm serve`), and
`deepinfer follow ...` on every host but the first of a model spread over several hosts.

Each subcommand is a parser built by the module that runs it, so `deepinfer serve` and
`python -m deepinfer.serve` accept the same options and run the same code (deepinfer/serve/cli.py).
"""

from __future__ import annotations

import argparse
import sys

from deepinfer.engine_config import add_engine_args, engine_config_from_args


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level: the server pulls in uvicorn and FastAPI.
    from deepinfer.serve import cli as serve_cli

    parser = argparse.ArgumentParser(prog="deepinfer", description="deepinfer command line.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible server",
                                description="OpenAI-compatible server for deepinfer.")
    serve_cli.add_server_args(serve)
    serve.set_defaults(run=serve_cli.run)
    follow = commands.add_parser(
        "follow", help="run this host's ranks of a model spread over several hosts",
        description="The ranks of host --node-rank (>= 1) of a model whose engine (node 0: LLM or "
                    "`deepinfer serve`) runs with the same --context-parallel-size / --expert-parallel-size "
                    "/ --nnodes / --master-addr / --master-port. Exits when the engine stops.")
    add_engine_args(follow)
    follow.set_defaults(run=_run_follow)
    return parser


def _run_follow(args: argparse.Namespace) -> int:
    import logging

    from deepinfer.executor.follower import run_host
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config = engine_config_from_args(args)
    except ValueError as e:
        print(f"deepinfer follow: invalid argument: {e}", file=sys.stderr)
        return 2
    return run_host(engine_config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())

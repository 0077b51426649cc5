"""The `deepinfer` console script: `deepinfer serve --model PATH ...` (like `vllm serve`).

Each subcommand is a parser built by the module that runs it, so `deepinfer serve` and
`python -m serve` accept the same options and run the same code (serve/cli.py).
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level: the server pulls in uvicorn and FastAPI.
    from serve import cli as serve_cli

    parser = argparse.ArgumentParser(prog="deepinfer", description="deepinfer command line.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible server",
                                description="OpenAI-compatible server for deepinfer.")
    serve_cli.add_server_args(serve)
    serve.set_defaults(run=serve_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())

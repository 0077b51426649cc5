"""`python -m deepinfer.serve --model PATH ...` (also `deepinfer serve`): parse arguments, build the engine
loop and run uvicorn."""

from __future__ import annotations

import argparse
import logging
import time

import uvicorn

from deepinfer.engine_config import EngineConfig, add_engine_args, engine_config_from_args
from deepinfer.logging_config import configure_logging
from deepinfer.serve.app import build_app
from deepinfer.serve.engine_loop import RANK_FAILURE_POLICIES, EngineLoop
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.reasoning import DEFAULT_REASONING_PARSER, REASONING_PARSERS
from deepinfer.serve.state import DEFAULT_MAX_BODY_BYTES, ServerConfig, ServerState

logger = logging.getLogger(__name__)

# uvicorn's own cancel-everything deadline comes this long after ours, so the engine's abort
# outputs (finish_reason "abort", then [DONE]) reach the clients before connections are cut.
_UVICORN_GRACE_S = 5.0


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every engine option (from EngineConfig) plus the options only the server has."""
    add_engine_args(parser)
    p = parser.add_argument_group("server options")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model argument)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-pending", type=int, default=0,
                   help="engine requests in flight before new ones get 503 (default: 0, unlimited)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM before they are aborted "
                        "(default: 30)")
    p.add_argument("--reasoning-parser", default=DEFAULT_REASONING_PARSER, choices=REASONING_PARSERS,
                   help="how thinking-mode replies are split into reasoning_content and content "
                        f"(default: {DEFAULT_REASONING_PARSER}; none: the raw text is the content)")
    p.add_argument("--on-rank-failure", default="exit", choices=RANK_FAILURE_POLICIES,
                   help="when a rank of the model dies or hangs (several ranks), after failing every request "
                        "with 503: 'exit' shuts the server down with exit code 1 (a supervisor restarts it), "
                        "'serve-503' keeps it up answering 503 (default: exit)")
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                   help="log level of the server, the engine and uvicorn (default: DEEPINFER_LOG_LEVEL "
                        "for the deepinfer loggers, the server's included; info for uvicorn)")
    return parser


def build_parser(prog: str = "python -m deepinfer.serve") -> argparse.ArgumentParser:
    return add_server_args(argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible server for deepinfer."))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class _Server(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT first drains the engine, then stops serving."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        # Not calling super(): it records the signal and re-raises it after shutdown, which would
        # turn a clean drain into death by signal.
        if self.should_exit:  # a second signal: stop waiting for anything
            self.force_exit = True
            return
        logger.info("signal %s: draining (%.1f s), then exiting", sig, self.shutdown_timeout)
        self.engine_loop.drain(self.shutdown_timeout)
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        logger.error("exiting: %s", reason)
        self.exit_code = 1
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT or a fatal engine error; returns the exit code."""
    log_level = args.log_level or "info"
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level is not None:   # else the deepinfer loggers keep DEEPINFER_LOG_LEVEL
        configure_logging(args.log_level)
    try:
        engine_config, server_config = _configs(args)
    except ValueError as e:
        logger.error("invalid argument: %s", e)
        return 2

    def build_engine():
        from deepinfer.engine.llm_engine import LLMEngine
        return LLMEngine(engine_config)

    engine_loop = EngineLoop(build_engine, ServerMetrics(), on_rank_failure=args.on_rank_failure)
    app = build_app(ServerState(server_config, engine_loop))
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                               timeout_graceful_shutdown=args.shutdown_timeout + _UVICORN_GRACE_S,
                               access_log=log_level == "debug")
    server = _Server(uv_config, engine_loop, args.shutdown_timeout)
    logger.info("serving %s as %r on http://%s:%d (api key %s, max pending %s)", engine_config.model,
                server_config.served_model_name, args.host, args.port, "required" if args.api_key else "off",
                args.max_pending or "unlimited")
    engine_loop.on_fatal = server.fatal
    server.run()
    return server.exit_code


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    engine_config = engine_config_from_args(args)
    server_config = ServerConfig(
        served_model_name=args.served_model_name or args.model, api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
        max_pending=args.max_pending, created=int(time.time()),
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser)
    return engine_config, server_config

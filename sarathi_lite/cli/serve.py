"""``sarathi-lite serve [MODEL]``: the OpenAI-compatible server (``sarathi_lite.server``) on uvicorn.

Every engine option is a flag, and so is every server limit (``ServerConfig``: queue bound, body size, read
timeouts, request timeout, API key, chat max_tokens default). Unless ``--stats-window`` says otherwise, the
server keeps the records of only the last 10,000 finished requests and iterations, so its memory stays bounded
however long it runs. The API key may come from the SARATHI_LITE_API_KEY environment variable instead of
``--api-key`` (which ``ps`` shows). Needs the ``[serve]`` extra.

``--instances 2P1D`` (x prefill and y decode instances; ``--conditional-threshold T`` prefills prompts of at most
T tokens on a decode instance), ``--instances 1PH1DH`` (a hybrid of prefill-heavy and decode-heavy colocated
instances, optionally with its rule, ``1PH1DH/short=256,ttft=2048,tbt=512``) or ``--data-parallel-size N`` (N
colocated replicas) start every instance as its own process behind the router (``sarathi_lite.engine.instances``),
each with ``--threads`` torch threads (default 1), and put the server in front.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

from sarathi_lite.cli.common import add_engine_args, add_threads_arg, apply_threads, engine_config
from sarathi_lite.engine.config import EngineConfig, parse_chunk_size
from sarathi_lite.scheduler.routing import Layout
from sarathi_lite.server.config import API_KEY_ENV, ServerConfig

logger = logging.getLogger(__name__)

DEFAULT_STATS_WINDOW = 10_000


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from sarathi_lite.server import build_app
        from sarathi_lite.server.limits import header_timeout_protocol
    except ImportError as e:
        raise RuntimeError(f"serve needs the [serve] extra (pip install 'sarathi-lite[serve]'): {e}") from e
    apply_threads(args)
    config = engine_config(args)
    changes: dict[str, Any] = {}
    if args.model_arg is not None:
        changes["model"] = args.model_arg
    if config.stats_window is None:
        changes["stats_window"] = DEFAULT_STATS_WINDOW
    limits = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)
              if getattr(args, f.name, None) is not None}
    if "api_key" not in limits and os.environ.get(API_KEY_ENV):
        limits["api_key"] = os.environ[API_KEY_ENV]
    server_config = ServerConfig(**limits)
    engine = serve_engine(args, config.replace(**changes))
    app = build_app(engine, args.served_model_name, server_config)
    logger.info("serving %s on http://%s:%d", args.served_model_name or engine.model_path.name, args.host,
                args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False,
                http=header_timeout_protocol(server_config.header_timeout))
    return 0


def serve_engine(args: argparse.Namespace, config: EngineConfig) -> Any:
    """The engine ``serve`` puts the server in front of: one ``LLMEngine``, or, with ``--instances`` or
    ``--data-parallel-size``, a ``ProcessEngine`` of instances as processes. Raises ``ValueError`` for a bad
    layout."""
    from sarathi_lite.engine.instances import ProcessEngine
    from sarathi_lite.engine.llm_engine import LLMEngine

    instances, replicas = getattr(args, "instances", None), getattr(args, "data_parallel_size", None)
    threshold = getattr(args, "conditional_threshold", None)
    prefill_chunk = getattr(args, "prefill_chunk_size", None)
    if prefill_chunk is not None and (instances is None or Layout.parse(instances, threshold).colocated):
        raise ValueError(f"--prefill-chunk-size {prefill_chunk} needs --instances xPyD or xPHyDH "
                         f"(prefill or prefill-heavy instances)")
    if instances is not None and replicas is not None:
        raise ValueError("give --instances or --data-parallel-size, not both")
    if replicas is not None:
        if replicas < 1:
            raise ValueError(f"--data-parallel-size={replicas} must be >= 1")
        instances = str(replicas)
    if instances is None:
        if threshold is not None:
            raise ValueError("--conditional-threshold needs --instances xPyD")
        return LLMEngine(config=config)
    if replicas == 1:
        return LLMEngine(config=config)
    prefill = None if prefill_chunk is None else {"chunk_size": parse_chunk_size(prefill_chunk)}
    return ProcessEngine(instances=Layout.parse(instances, threshold), config=config, prefill_options=prefill,
                         num_threads=getattr(args, "threads", None) or 1)


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the ``sarathi-lite`` subcommands."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__)
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="built-in name or checkpoint folder (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint folder's name)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   help="uvicorn's log level: critical, error, warning (default), info, debug or trace")
    g = p.add_argument_group("instances (each its own process behind a router)")
    g.add_argument("--instances", default=None, metavar="LAYOUT",
                   help="N colocated replicas, xPyD prefill and decode instances (e.g. 2P1D), or a hybrid xPHyDH "
                        "(e.g. 1PH1DH; routing.HybridRule) (default: one engine)")
    g.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="N colocated replicas as processes (the same as --instances N)")
    g.add_argument("--conditional-threshold", type=int, default=None, metavar="TOKENS",
                   help="with --instances xPyD: prompts of at most this many tokens are prefilled on a decode "
                        "instance")
    g.add_argument("--prefill-chunk-size", default=None, metavar="TOKENS",
                   help="with --instances xPyD or xPHyDH: the prefill (prefill-heavy) instances' chunk size, a token "
                        "count or auto (--chunk-size sets the decode or decode-heavy ones)")
    add_engine_args(p, config_class=ServerConfig, title="server limits (ServerConfig)")
    add_threads_arg(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

"""``sarathi-lite serve [MODEL]``: the OpenAI-compatible server (``sarathi_lite.server``) on uvicorn.

Every engine option is a flag. Unless ``--stats-window`` says otherwise, the server keeps the records of only
the last 10,000 finished requests and iterations, so its memory stays bounded however long it runs. Needs the
``[serve]`` extra.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sarathi_lite.cli.common import add_engine_args, add_threads_arg, apply_threads, engine_config

logger = logging.getLogger(__name__)

DEFAULT_STATS_WINDOW = 10_000


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from sarathi_lite.server import build_app
    except ImportError as e:
        raise RuntimeError(f"serve needs the [serve] extra (pip install 'sarathi-lite[serve]'): {e}") from e
    from sarathi_lite.engine.llm_engine import LLMEngine

    apply_threads(args)
    config = engine_config(args)
    changes: dict[str, Any] = {}
    if args.model_arg is not None:
        changes["model"] = args.model_arg
    if config.stats_window is None:
        changes["stats_window"] = DEFAULT_STATS_WINDOW
    engine = LLMEngine(config=config.replace(**changes))
    app = build_app(engine, args.served_model_name)
    logger.info("serving %s on http://%s:%d", args.served_model_name or engine.model_path.name, args.host,
                args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False)
    return 0


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the ``sarathi-lite`` subcommands."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="built-in name or checkpoint folder (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint folder's name)")
    g.add_argument("--uvicorn-log-level", default="warning")
    add_threads_arg(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

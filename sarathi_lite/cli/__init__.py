"""sarathi-lite: chunked-prefill LLM inference scheduling, from the command line.

  generate   run prompts under the chunked-prefill scheduler; show how each iteration mixed prefill chunks and
             decodes, then TTFT/TBT
  serve      serve a model over an OpenAI-compatible HTTP API (one engine, replicas, or prefill/decode instances)
  bench      replay a workload online under several scheduler configurations (or against any OpenAI server)
  capacity   the highest request rate that meets a P99 TBT SLO, per policy, by real runs
  profile    time this machine's model runner over batch shapes; save the cost model sim uses
  sim        simulate a workload under several scheduler configurations on a cost model (no model run)
  sweep      simulate traces x rates x cost models x configurations x SLOs in parallel; one CSV
  plan       rank deployments of a model on GPUs by simulated goodput under TTFT and TBT SLOs

Every engine option is a flag of the commands that run the engine: sarathi-lite COMMAND --help.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sarathi_lite.cli.bench import add_bench_parsers
from sarathi_lite.cli.common import STOPPED, HelpFormatter
from sarathi_lite.cli.generate import add_generate_parser
from sarathi_lite.cli.plan import add_plan_parser
from sarathi_lite.cli.serve import add_serve_parser
from sarathi_lite.cli.sim import add_sim_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sarathi-lite", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parsers(sub)
    add_sim_parsers(sub)
    add_serve_parser(sub)
    add_plan_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    restore = _stop_on_sigterm()
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"sarathi-lite: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command that keeps partial results saves them itself (and returns STOPPED)
        print("\nsarathi-lite: stopped, with nothing finished to save", file=sys.stderr)
        return STOPPED
    finally:
        restore()


def _stop_on_sigterm() -> Callable[[], None]:
    """SIGTERM stops a command as Ctrl-C does (a ``KeyboardInterrupt``: what it finished is saved, it exits with
    ``STOPPED``) instead of killing it; returns the function that puts the previous handler back. Only the main
    thread can set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

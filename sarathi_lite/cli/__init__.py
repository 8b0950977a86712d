"""``sarathi-lite``: the command line. ``generate`` runs prompts under the chunked-prefill scheduler and shows
how each iteration mixed prefill chunks and decodes, then TTFT/TBT; ``bench`` and ``capacity`` run the serving
benchmark; ``sim`` and ``profile`` the simulator; ``serve`` the OpenAI-compatible server; ``plan`` ranks
deployments under SLOs. Every engine option is a flag (``sarathi-lite CMD --help``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sarathi_lite.cli.bench import add_bench_parsers
from sarathi_lite.cli.generate import add_generate_parser
from sarathi_lite.cli.plan import add_plan_parser
from sarathi_lite.cli.serve import add_serve_parser
from sarathi_lite.cli.sim import add_sim_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sarathi-lite", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parsers(sub)
    add_sim_parsers(sub)
    add_serve_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"sarathi-lite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

r"""``sarathi-lite plan``: which deployment of MODEL on GPUS x GPU serves the most requests per GPU within a TTFT
and a P99 TBT SLO, simulated (``sarathi_lite.plan``): colocated replicas at each chunk size and ``auto``, every
xPyD split, its conditional and its hybrid (xPHyDH) variants, tensor and pipeline degrees that fit; a ranked table
with the arguments that run each, the commands of the best, and optionally a figure and the JSON.

    sarathi-lite plan --model llama3-8b --gpu h100 --gpus 4 --trace conversation --ttft-slo 1 --tbt-slo 0.05

On this machine, priced by its own measured profile, then the top two run for real (instance processes):

    sarathi-lite plan --model smollm2-135m --gpu cpu --gpus 2 --profile benchmarks/results/sim_profile_smollm2.json \
        --prompt-scale 0.25 --output-scale 0.25 --max-prompt 1024 --max-output 128 --start 1000 \
        --ttft-slo 5 --tbt-slo 1.065 --chunk-sizes 128,256,512,auto --prefill-chunk-size 512 \
        --decode-chunk-size 256 --conditional-threshold 128 --real 2

Each candidate is simulated at several rates (a few seconds each on a small machine, all CPUs used): the number
of candidates, printed with the progress bar, sets the time (llama3-8b on 4 GPUs: 38; on 8: 72, 94 over three SLO
pairs). Stopped with
Ctrl-C, it prints the ranking of the candidates searched so far (and writes it to --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli.common import add_no_progress_arg, add_old_spelling, stopped
from sarathi_lite.plan import CHUNK_SIZES, Setup, commands, plan_slos, plot, table
from sarathi_lite.plan.real import confirm
from sarathi_lite.plan.report import summary
from sarathi_lite.plan.space import MAX_CANDIDATES, parse_chunk_sizes
from sarathi_lite.sim.disagg import DEFAULT_ATTAINMENT, LINKS
from sarathi_lite.sim.sweeps import BACKENDS


def cmd_plan(args: argparse.Namespace) -> int:
    slos = args.slo or [(args.ttft, args.tbt)]
    if any(x is None for pair in slos for x in pair):
        raise ValueError("give --ttft-slo and --tbt-slo, or one --slo TTFT,TBT per SLO pair")
    setup = Setup(args.model, args.gpu, args.gpus, *slos[0], args.attainment,
                  chunk_sizes=parse_chunk_sizes(args.chunk_sizes), prefill_chunk=args.prefill_chunk,
                  decode_chunk=args.decode_chunk, threshold=args.threshold if args.threshold >= 0 else None,
                  hybrid=not args.no_hybrid, link=args.link, max_degree=args.max_degree, checkpoint=args.checkpoint,
                  profile=args.profile)
    workload = _workload(args)
    results = plan_slos(setup, workload, slos, min_requests=args.num_requests, max_requests=args.max_requests,
                        fine_probes=args.fine_probes, backend=args.backend, workers=args.workers,
                        address=args.address, progress=not args.no_progress)
    if results[0].stopped:
        print(f"\nStopped: {results[0].stopped}; the ranking below covers those candidates only.\n")
    for result in results:
        print(table(result, top=args.top) + "\n")
    if len(results) > 1:
        print("Best per SLO pair:\n" + summary(results) + "\n")
    result = results[0]
    print("Top entries" + (f" (TTFT {setup.ttft:g} s, TBT {setup.tbt:g} s)" if len(results) > 1 else "") + ":\n"
          + commands(result, top=min(3, len(result.entries))))
    if args.plot:
        print(f"plot: {plot(result, args.plot, top=args.top or 20)}")
    out: dict[str, Any] = result.to_dict() if len(results) == 1 else {"plans": [r.to_dict() for r in results]}
    if args.real and not result.stopped:
        real = confirm(result, workload, top=args.real, num_requests=args.real_requests,
                       threads=args.real_threads, progress=not args.no_progress)
        print("\nReal runs on this machine:\n" + real.table())
        out["real"] = real.to_dict()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    if result.stopped:
        return stopped(result.stopped, f"the ranking above, and in {args.json} (its \"stopped\" says so)"
                       if args.json else "the ranking above, not saved (--json FILE saves it)")
    return 0


class _BothScales(argparse.Action):
    """``--length-scale X``, the old spelling of ``--prompt-scale X --output-scale X`` (kept for one release)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print("sarathi-lite: --length-scale is now --prompt-scale and --output-scale; the old spelling goes in "
              "the next release", file=sys.stderr)
        namespace.prompt_scale = namespace.output_scale = values


def _slo(text: str) -> tuple[float, float]:
    """``"1,0.05"`` -> ``(1.0, 0.05)`` (TTFT, P99 TBT; seconds)."""
    try:
        ttft, tbt = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slo {text!r}: expected TTFT,TBT in seconds, e.g. 1,0.05") from None
    return ttft, tbt


def _workload(args: argparse.Namespace) -> Workload:
    if args.num_requests < 1 or args.max_requests < args.num_requests:
        raise ValueError(f"--num-requests {args.num_requests} and --max-requests {args.max_requests}: need "
                         f"1 <= num-requests <= max-requests")
    if args.lengths:
        return Workload.synthetic(args.lengths, num_requests=args.max_requests, qps=1.0,
                                  max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)
    return Workload.from_trace(args.trace, num_requests=args.max_requests, start=args.start, qps=1.0,
                               prompt_scale=args.prompt_scale, output_scale=args.output_scale,
                               max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)


def add_plan_parser(sub: Any) -> None:
    """Add ``plan`` to the ``sarathi-lite`` subcommands."""
    p = sub.add_parser("plan", help="rank deployments of a model on GPUs by simulated goodput under SLOs",
                       description=__doc__)
    p.add_argument("--model", required=True, help="a model shape preset (llama3-8b, llama3-70b, ...) or a "
                                                   "config.json / checkpoint folder")
    p.add_argument("--gpu", required=True, help="a hardware preset (h100, a100-80gb, h200)")
    p.add_argument("--gpus", type=int, required=True,
                   help=f"how many GPUs (a search takes at most {MAX_CANDIDATES} candidate deployments: with the "
                        f"default space, up to about 128 GPUs)")
    p.add_argument("--ttft-slo", dest="ttft", type=float, default=None, help="TTFT SLO (seconds)")
    p.add_argument("--tbt-slo", dest="tbt", type=float, default=None,
                   help="per-request P99 time-between-tokens SLO (seconds)")
    add_old_spelling(p, "--ttft", "--ttft-slo", dest="ttft", type=float)
    add_old_spelling(p, "--tbt", "--tbt-slo", dest="tbt", type=float)
    p.add_argument("--slo", type=_slo, action="append", default=None, metavar="TTFT,TBT",
                   help="an SLO pair (seconds; repeat for several): one search judges every pair, a table for each "
                        "and the best per pair (instead of --ttft-slo/--tbt-slo; the commands, --plot and --real use "
                        "the first pair)")
    p.add_argument("--attainment", type=float, default=DEFAULT_ATTAINMENT,
                   help=f"share of requests that must meet both SLOs (default {DEFAULT_ATTAINMENT})")
    g = p.add_argument_group("workload (lengths and order; the search sets the rates)")
    g.add_argument("--trace", default="conversation", help="a built-in trace (conversation, arxiv) or a CSV path")
    g.add_argument("--lengths", default=None, help="synthetic lengths instead of a trace (as sarathi-lite sim)")
    g.add_argument("--start", type=int, default=0, help="first trace row")
    g.add_argument("--prompt-scale", type=float, default=1.0,
                   help="scale the trace's prompt lengths, before clipping (default 1; the CPU studies' 0.25)")
    g.add_argument("--output-scale", type=float, default=1.0,
                   help="scale the trace's output lengths, before clipping (default 1; the CPU studies' 0.25)")
    g.add_argument("--length-scale", action=_BothScales, type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    g.add_argument("--max-prompt", type=int, default=7000, help="clip prompts (tokens; the study's 7,000)")
    g.add_argument("--max-output", type=int, default=1000, help="clip outputs (tokens; the study's 1,000)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths and arrivals (default 0)")
    g = p.add_argument_group("search")
    g.add_argument("--chunk-sizes", default=",".join(map(str, CHUNK_SIZES)),
                   help="colocated chunk sizes, comma-separated, 'auto' included (default %(default)s)")
    g.add_argument("--prefill-chunk-size", dest="prefill_chunk", type=int, default=2048,
                   help="prefill (and prefill-heavy) instances' chunk size (default 2048)")
    g.add_argument("--decode-chunk-size", dest="decode_chunk", type=int, default=512,
                   help="decode (and decode-heavy) instances' chunk size (default 512)")
    add_old_spelling(g, "--prefill-chunk", "--prefill-chunk-size", dest="prefill_chunk", type=int)
    add_old_spelling(g, "--decode-chunk", "--decode-chunk-size", dest="decode_chunk", type=int)
    g.add_argument("--profile", default=None,
                   help="price every instance with this measured profile (`sarathi-lite profile` JSON) instead of "
                        "the --gpu preset, which is then a label (e.g. cpu)")
    g.add_argument("--conditional-threshold", dest="threshold", type=int, default=512,
                   help="conditional variants: prompts of at most this many tokens are prefilled on a decode "
                        "instance (default 512; -1: no conditional variants)")
    add_old_spelling(g, "--threshold", "--conditional-threshold", dest="threshold", type=int)
    g.add_argument("--no-hybrid", action="store_true",
                   help="no hybrid variants (prefill-heavy and decode-heavy colocated instances)")
    g.add_argument("--link", default="infiniband", choices=list(LINKS), help="KV transfer link")
    g.add_argument("--max-degree", type=int, default=None, help="largest tensor x pipeline degree tried")
    g.add_argument("--num-requests", type=int, default=300,
                   help="fewest requests per probe (default 300; a probe simulates 15 s of arrivals, within "
                        "--num-requests and --max-requests)")
    add_old_spelling(g, "--requests", "--num-requests", dest="num_requests", type=int)
    g.add_argument("--max-requests", type=int, default=1500, help="most requests per probe (default 1500)")
    g.add_argument("--fine-probes", type=int, default=3, help="probes refining each contender (default 3)")
    g.add_argument("--backend", default=None, choices=BACKENDS, help="sweep backend (default: process pool)")
    g.add_argument("--workers", type=int, default=None, help="processes (default: the CPU count)")
    g.add_argument("--address", default=None, help="a Ray cluster's address (selects the ray backend)")
    g = p.add_argument_group("real runs (a plan made with --profile of this machine)")
    g.add_argument("--real", type=int, default=0, metavar="N",
                   help="run the top N entries here (instance processes on the CPU) at each one's planned goodput "
                        "and check they rank as planned (0: no real runs)")
    g.add_argument("--real-requests", type=int, default=60, help="requests per real run (default 60)")
    g.add_argument("--real-threads", type=int, default=1, help="torch threads per instance (default 1)")
    g = p.add_argument_group("output")
    g.add_argument("--checkpoint", default=None, help="the model the printed commands name (default: --model)")
    g.add_argument("--top", type=int, default=None, help="rows of the table (default: all)")
    g.add_argument("--plot", default=None, help="write the ranking's figure to this file (needs matplotlib)")
    g.add_argument("--json", default=None, help="write the plan (every probe) to this JSON file")
    add_no_progress_arg(g)
    p.set_defaults(func=cmd_plan)

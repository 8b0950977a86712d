"""The flags every ``sarathi-lite`` subcommand shares, built from ``EngineConfig`` rather than listed by hand.

``add_engine_args(parser)`` turns each engine option (``sarathi_lite.engine.config.OPTIONS``: ``EngineConfig``'s
own fields and those of its nested ``SchedulerConfig``, ``ParallelConfig`` and ``KVTransferConfig``) into one flag
(``chunk_size`` -> ``--chunk-size``) with the field's type, choices and help (its ``metadata``), and ``None`` as
the flag's default, so the one default of each option stays the dataclass's; ``engine_config(args)`` turns the
flags that were given back into an ``EngineConfig``. A field added to any of these dataclasses gets its flag by
itself.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from sarathi_lite.bench.capacity import SLO, CapacityResult
from sarathi_lite.bench.plots import plot_capacity, plot_results
from sarathi_lite.bench.results import BenchResult, compare, save_results
from sarathi_lite.bench.workload import Workload
from sarathi_lite.engine.config import OPTIONS, SCHEDULER_FIELDS, EngineConfig, Option, config_options, parse_chunk_size
from sarathi_lite.scheduler import POLICIES

# The fields that shape what the scheduler does, which the simulator models (no model, no device). A field
# outside the scheduler's that the simulator also reads says so with ``metadata={"sim": True}``.
SIM_FIELDS = (*SCHEDULER_FIELDS, "num_kv_blocks", "max_model_len",
              *(o.name for o in OPTIONS.values() if o.metadata.get("sim") and o.name not in SCHEDULER_FIELDS))


_LITERAL = re.compile(r"``(.+?)``|`([^`\n]+)`", re.S)


def plain(text: str) -> str:
    """``text`` with its reST (and Markdown) literals rendered as plain text: ````x```` and ```x``` -> ``x``."""
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every ``sarathi-lite`` command's help: descriptions keep their line breaks (examples, lists, continued
    command lines), and the docstrings' and fields' reST literals are shown as plain text."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


class _OldSpelling(argparse.Action):
    """A flag's old spelling, hidden from the help: stores into the new flag's ``dest`` and says the new name on
    stderr (kept for one release)."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"sarathi-lite: {option_string} is now {self.new}; the old spelling goes in the next release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_old_spelling(parser: Any, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """Accept ``old``, hidden from the help, as the flag ``new`` (whose ``dest`` it fills); ``kwargs`` as
    ``new``'s (``type=``, ``metavar=``)."""
    parser.add_argument(old, action=_OldSpelling, new=new, dest=dest, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS, **kwargs)


def option_fields(config_class: type = EngineConfig) -> tuple[Option, ...]:
    """The options ``add_engine_args`` makes flags of: ``EngineConfig``'s (nested configs' fields by their
    option names), or another dataclass's fields."""
    return config_options(config_class)


def flag_name(f: Option) -> str:
    """The command-line option of an engine option (or a dataclass field): ``--`` + ``metadata["flag"]`` or its
    name, with dashes."""
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def _parser(f: Option, annotation: Any) -> Callable[[str], Any] | None:
    """How the flag's text becomes a value: ``metadata["type"]``, else the annotation's one non-``None`` type
    (``int | None`` -> ``int``); ``None`` for ``bool`` (an on/off flag) and ``str``."""
    if "type" in f.metadata:
        return f.metadata["type"]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"field {f.name}: give metadata['type'] for the annotation {annotation}")
        annotation = kinds[0]
    if annotation in (int, float):
        return annotation
    if annotation in (str, bool):
        return None
    raise TypeError(f"field {f.name}: give metadata['type'] for the annotation {annotation}")


def add_engine_args(parser: argparse.ArgumentParser, *, fields: Iterable[str] | None = None,
                    exclude: Iterable[str] = (), config_class: type = EngineConfig,
                    title: str = "engine options (EngineConfig)") -> None:
    """Add one flag per engine option (``option_fields``; only ``fields`` if given, never those in ``exclude``)
    to ``parser``, in a group ``title``. Every flag defaults to ``None``: "not given", so ``engine_config``
    leaves the option at its default, which the help text shows. config_class: another dataclass whose fields
    carry the same metadata."""
    wanted = None if fields is None else set(fields)
    skipped = set(exclude)
    group = parser.add_argument_group(title)
    for f in option_fields(config_class):
        if (wanted is not None and f.name not in wanted) or f.name in skipped:
            continue
        help_text = f.metadata.get("help", "")
        if f.field.default is not None and f.field.default is not MISSING:
            help_text += f" (default: {f.field.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kind = _parser(f, f.annotation)
            if kind is not None:
                kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = tuple(f.metadata["choices"])
        group.add_argument(flag_name(f), **kwargs)


def set_flag_help(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """Replace the help of ``parser``'s ``flag`` (a command whose default differs from the engine's says so)."""
    next(a for a in parser._actions if flag in a.option_strings).help = help_text


def engine_options(args: argparse.Namespace, fields: Iterable[str] | None = None) -> dict[str, Any]:
    """The engine options given on the command line (those of ``fields`` if given), by option name."""
    names = list(OPTIONS) if fields is None else list(fields)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def engine_config(args: argparse.Namespace, fields: Iterable[str] | None = None, **changes: Any) -> EngineConfig:
    """The ``EngineConfig`` of the flags ``add_engine_args`` added: given ones set, the rest at their defaults;
    ``changes`` override both. Raises ``ValueError`` naming a bad value."""
    return EngineConfig(**{**engine_options(args, fields), **changes})


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads for the commands that run the model."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 is steadier on a CPU shared with other work; "
                             "use the same for profile and bench runs)")


def apply_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (imports torch, so only for commands that run the model)."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def csv_of(kind: type) -> Callable[[str], list]:
    """An argparse type: comma-separated values of ``kind``."""
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x]

    return parse


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags of ``bench``, ``capacity`` and ``sim``."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="conversation",
                   help="a built-in trace (conversation, arxiv) or the path of a trace CSV")
    g.add_argument("--lengths", default=None,
                   help="synthetic lengths instead of a trace: fixed:P:O | uniform:PMIN-PMAX:OMIN-OMAX | "
                        "zipf:PMIN-PMAX:OMIN-OMAX[:THETA]")
    g.add_argument("--num-requests", type=int, default=30,
                   help="requests in the workload (with --turns: conversations) (default 30)")
    g.add_argument("--start", type=int, default=1000, help="first trace row")
    g.add_argument("--qps", type=float, default=0.5,
                   help="Poisson arrivals at this rate (requests/s); 0: the trace's own arrival times")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="with --qps 0: multiply the trace's arrival times (2 halves the rate)")
    g.add_argument("--prompt-scale", type=float, default=0.25, help="scale prompt lengths (before clipping)")
    g.add_argument("--output-scale", type=float, default=0.25, help="scale output lengths (before clipping)")
    g.add_argument("--max-prompt", type=int, default=1024, help="clip prompt lengths (tokens)")
    g.add_argument("--max-output", type=int, default=128, help="clip output lengths (tokens)")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals, synthetic lengths and prompt tokens")
    g.add_argument("--system-prompt", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N-token system prompt (prefix caching)")
    g.add_argument("--turns", type=int, default=None, metavar="K",
                   help="multi-turn chats of K turns from the trace, turn k resending turns 1..k-1; "
                        "--num-requests then counts conversations and --qps their starts")
    g.add_argument("--turn-gap", type=float, default=10.0, help="seconds between a chat's turns (--turns)")
    g.add_argument("--long-prompts", type=_long_prompts, default=None, metavar="N:LEN[:OUT]",
                   help="long-context traffic: N requests (drawn from the seed) get a LEN-token prompt (and OUT "
                        "output tokens), e.g. 10:60000 among short ones")


def _long_prompts(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(x) for x in text.split(":"))
    except ValueError:
        parts = ()
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--long-prompts {text!r}: expected N:LEN or N:LEN:OUT")
    return parts


def build_workload(args: argparse.Namespace) -> Workload:
    """The ``Workload`` of ``add_workload_args``' flags. Raises ``ValueError`` naming a bad flag."""
    if args.num_requests < 1:
        raise ValueError(f"--num-requests {args.num_requests}: need at least 1"
                         + (" conversation" if args.turns else " request"))
    workload = _base_workload(args)
    if getattr(args, "long_prompts", None):
        workload = workload.with_long_prompts(*args.long_prompts)
    return workload


def _base_workload(args: argparse.Namespace) -> Workload:
    qps = args.qps or None
    if args.turns:
        workload = Workload.conversations(args.trace, num_conversations=args.num_requests, turns=args.turns,
                                          qps=qps, turn_gap=args.turn_gap, start=args.start,
                                          prompt_scale=args.prompt_scale, output_scale=args.output_scale,
                                          max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)
    elif args.lengths:
        workload = Workload.synthetic(args.lengths, num_requests=args.num_requests, qps=qps,
                                      max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)
    else:
        workload = Workload.from_trace(args.trace, num_requests=args.num_requests, start=args.start, qps=qps,
                                       time_scale=args.time_scale, prompt_scale=args.prompt_scale,
                                       output_scale=args.output_scale, max_prompt=args.max_prompt,
                                       max_output=args.max_output, seed=args.seed)
    return workload.with_system_prompt(args.system_prompt) if args.system_prompt else workload


def add_sweep_args(p: argparse.ArgumentParser, *, chunk_sizes: bool = True) -> None:
    """``--policies`` (and ``--chunk-sizes``): the configurations a comparison runs."""
    p.add_argument("--policies", type=csv_of(str), default=None,
                   help=f"comma-separated, of {','.join(POLICIES)} (default: --scheduler, else sarathi,vllm)")
    if chunk_sizes:
        p.add_argument("--chunk-sizes", type=csv_of(parse_chunk_size), default=None,
                       help="comma-separated chunk sizes (or auto) for the chunked policies (default: "
                            "--chunk-size)")


def policies(args: argparse.Namespace) -> list[str]:
    """``--policies``, else ``--scheduler``, else sarathi and vllm. Raises ``ValueError`` for an unknown one."""
    chosen = args.policies or ([args.policy] if args.policy else ["sarathi", "vllm"])
    unknown = sorted(set(chosen) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    return chosen


def add_capacity_args(g: Any, *, tbt_required: bool, probes: int, probes_help: str) -> None:
    """The capacity search's flags (SLO, rate range, probes), shared by ``capacity`` and ``sim --capacity``."""
    g.add_argument("--tbt-slo", type=float, required=tbt_required, default=None,
                   help="P99 TBT bound (seconds); also the per-iteration target of --chunk-size auto")
    g.add_argument("--max-scheduling-delay", type=float, default=2.0, help="median scheduling delay bound (s)")
    add_rate_range_args(g)
    g.add_argument("--probes", type=int, default=probes, help=probes_help)


def add_rate_range_args(g: Any) -> None:
    """``--qps-low`` and ``--qps-high``: the range a capacity search bisects."""
    g.add_argument("--qps-low", type=float, default=0.1,
                   help="lowest arrival rate the capacity search tries (requests/s; default 0.1)")
    g.add_argument("--qps-high", type=float, default=2.0,
                   help="highest arrival rate the capacity search tries (requests/s; default 2.0)")


def add_no_progress_arg(p: Any) -> None:
    """``--no-progress``: no progress bars (logs, CI)."""
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def slo_from_args(args: argparse.Namespace) -> SLO:
    """The ``SLO`` of ``add_capacity_args``' flags, printed."""
    slo = SLO(args.tbt_slo, args.max_scheduling_delay)
    print(f"SLO: P99 TBT <= {1000 * slo.tbt_p99:.0f} ms, median scheduling delay <= {slo.scheduling_delay_p50} s")
    return slo


# The list of files a run of these commands wrote into its --out folder, so the next run there can clear them.
RUN_FILES = "run_files.json"


def fresh_folder(out_dir: str | Path) -> Path:
    """``out_dir`` made ready for one run's files: created if missing; the files an earlier run wrote there
    (listed in its ``run_files.json``) removed, so the folder ends up holding this run only. Raises
    ``ValueError`` naming the folder if it holds anything else (this never deletes what it did not write)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a folder")
    out.mkdir(parents=True, exist_ok=True)
    listed: set[str] = set()
    if (out / RUN_FILES).is_file():
        listed = {*json.loads((out / RUN_FILES).read_text()), RUN_FILES}
    others = sorted(p.name for p in out.iterdir() if p.name not in listed)
    if others:
        raise ValueError(f"--out {out} already holds files this command did not write ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}); give a new or empty folder")
    for name in listed:
        (out / name).unlink(missing_ok=True)
    return out


def record_run_files(out_dir: str | Path, paths: Sequence[Path]) -> None:
    """List ``paths`` (written to ``out_dir`` by one run) in its ``run_files.json`` for ``fresh_folder``."""
    Path(out_dir, RUN_FILES).write_text(json.dumps(sorted(Path(p).name for p in paths)))


# The exit status of a command stopped early (Ctrl-C, or SIGTERM), whatever it saved: 128 + SIGINT, as a shell's.
STOPPED = 130
# What a run's --out folder holds when the run stopped early: how far it got.
STOPPED_FILE = "stopped.json"


def stopped(progress: str, saved: str) -> int:
    """Say on stderr that the command stopped early after ``progress`` and what it ``saved`` (where, or why
    nothing); the command's exit status (``STOPPED``)."""
    print(f"\nsarathi-lite: stopped after {progress}; partial results: {saved}", file=sys.stderr)
    return STOPPED


def partial_path(path: str | Path) -> Path:
    """Where a stopped command writes the partial results it would have written to the file ``path``, beside it
    (``profile.json`` -> ``profile.partial.json``), so a whole result already there stays."""
    path = Path(path)
    return path.with_name(f"{path.stem}.partial{path.suffix}")


def save_comparison(results: Sequence[BenchResult], out_dir: str | Path | None, *, plot: str | None = None,
                    stopped_after: str = "") -> str:
    """Print ``compare(results)``; with ``out_dir``, write them (``save_results``) and, if ``plot`` names a file,
    the ``plot_results`` figure into it, a folder holding this run only (``fresh_folder``). stopped_after: a run
    stopped early, how far it got (written to the folder's ``stopped.json``). Returns what was saved, in words."""
    print(compare(results))
    if out_dir is None:
        return "printed above, not saved (--out DIR saves them)"
    out = fresh_folder(out_dir)
    paths = save_results(results, out) if results else []
    if plot and results:
        paths.append(plot_results(results, out / plot))
    paths += _stopped_note(out, stopped_after)
    record_run_files(out, paths)
    print(f"wrote {len(paths)} files to {out}" + (f", plot {out / plot}" if plot and results else ""))
    return f"the {len(results)} finished in {out} (its {STOPPED_FILE} says the run stopped)"


def save_capacity(found: Sequence[CapacityResult], out_dir: str | Path | None, *, plot: bool = False,
                  stopped_after: str = "") -> str:
    """Print ``capacity_table(found)``; with ``out_dir``, write ``capacity.json`` (and with ``plot``
    ``capacity.png``) into it, a folder holding this run only (``fresh_folder``). stopped_after: a run stopped
    early, how far it got (a search cut short says so in its ``stopped``, and the folder's ``stopped.json`` says
    how far the run got). Returns what was saved, in words."""
    print(capacity_table(found))
    if out_dir is None:
        return "printed above, not saved (--out DIR saves them)"
    out = fresh_folder(out_dir)
    (out / "capacity.json").write_text(json.dumps([c.to_dict() for c in found], indent=1))
    written = [out / "capacity.json"]
    if plot and found:
        written.append(plot_capacity(found, out / "capacity.png"))
    record_run_files(out, written + _stopped_note(out, stopped_after))
    print(f"wrote {', '.join(map(str, written))}")
    return f"the searches so far in {out / 'capacity.json'} (a search cut short has \"stopped\")"


def _stopped_note(out: Path, stopped_after: str) -> list[Path]:
    """For a run stopped early, ``out``'s ``stopped.json`` saying how far it got."""
    if not stopped_after:
        return []
    (out / STOPPED_FILE).write_text(json.dumps({"stopped": stopped_after,
                                                "partial": "this run stopped early: the results here are those "
                                                           "it finished"}, indent=1))
    return [out / STOPPED_FILE]


def capacity_table(found: Sequence[CapacityResult]) -> str:
    """One row per policy: capacity (requests/s), the lowest failing rate, and every probe."""
    lines = [f"{'config':<14} {'capacity req/s':>14} {'fails at':>9}  probes (req/s: P99 TBT ms, median delay s)"]
    for c in found:
        cap = "< range" if c.capacity is None else f"{c.capacity:.3f}"
        fail = "-" if c.failed_above is None else f"{c.failed_above:.3f}"
        probes = ", ".join(f"{p.qps:.3f}{'+' if p.passed else 'x'}: {_ms(p.tbt_p99)}/{_s(p.scheduling_delay_p50)}"
                           for p in c.probes)
        lines.append(f"{c.label:<14} {cap:>14} {fail:>9}  {probes}" + (f" (stopped after {c.stopped})" if c.stopped
                                                                        else ""))
    lines.append("probes: each rate the search tried, in order, + if it met the SLO and x if not, then the P99 TBT "
                 "(ms) / median scheduling delay (s) it measured there; capacity is the highest rate that met it")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"

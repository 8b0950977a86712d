"""vLLM's own scheduler on the simulator's clock: the installed release's ``Scheduler`` (or the plugin's
``SarathiScheduler``), driven model-free by ``harness.Harness``, each step's time taken from a sarathi-lite cost
model (``sarathi_lite.costs``: a profile, a roofline, the calibrated A100/H100 models), on the loop of
``sarathi_lite.sim.simulator.simulate`` with one stage: the host is ready when a step ends, a step starts at
``cost_model.start_time(ready)``, the requests that have arrived by then are added, and every step is recorded
in the same ``MetricsRecorder``, so the result is the ``BenchResult`` the simulator returns for our policies.
``sarathi-lite sim --policies vllm@0.34,sarathi`` runs it (``run_policy``), in the environment that holds that
release when this one does not (``python -m sarathi_lite.integrations.vllm.simclock``).

The KV pool, ``max_model_len``, ``max_num_seqs`` and block size are those the simulator gives our ``vllm_v1``
policy for the same options (``simulator.scheduler_config``), so the two differ only in the scheduling code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, load_cost_model
from sarathi_lite.metrics import MetricsRecorder
from sarathi_lite.scheduler import Request, ScheduledRequest, SchedulerOutput, make_scheduler
from sarathi_lite.sim import simulator

if TYPE_CHECKING:  # the harness imports vLLM: run_policy may run where only another environment has it
    from .harness import Harness, StepRecord


class _Finished:
    """A finished request as ``MetricsRecorder.record_step`` reads it."""

    __slots__ = ("request_id", "finish_reason")

    def __init__(self, request_id: str, finish_reason: str) -> None:
        self.request_id, self.finish_reason = request_id, finish_reason


def rows(record: StepRecord) -> SchedulerOutput:
    """vLLM's step as our ``SchedulerOutput`` (what a cost model prices and the metrics record)."""
    out = SchedulerOutput()
    prefills = set(record.prefills)
    for rid, n in record.scheduled.items():
        out.add(ScheduledRequest(rid, record.computed[rid], n, [], [], rid in record.sampled, rid in prefills))
    out.preempted_ids = list(record.preempted)
    return out


def run_on_clock(workload: Workload, cost_model: CostModel, *, label: str, chunk_size: int = 2048,
             scheduler: str = "default", plugin_options: dict[str, Any] | None = None,
             long_prefill_token_threshold: int = 0, vllm_fields: dict[str, Any] | None = None,
             record_batches: bool = False, **options: Any) -> tuple[BenchResult, Harness, Any]:
    """Serve ``workload`` with the installed vLLM's scheduler (``scheduler``: ``"default"`` or ``"plugin"``) on a
    simulated clock whose steps take ``cost_model.predict`` seconds. chunk_size: vLLM's
    ``max_num_batched_tokens``. vllm_fields: further vLLM ``SchedulerConfig`` fields
    (``long_prefill_token_threshold_adaptive``, ``prefill_schedule_interval``, ...). options: as for
    ``simulator.scheduler_config`` (``max_num_seqs``, ``block_size``, ``num_kv_blocks``, ``enable_prefix_caching``,
    ...). Returns the result, the harness that ran (its steps) and the ``SchedulerConfig`` our ``vllm_v1``
    policy gets for the same options. Raises ``ValueError`` if a request does not fit, as the simulator does."""
    from .harness import Harness, tiny_model

    wall = time.perf_counter()
    config = simulator.scheduler_config(cost_model, "vllm_v1", chunk_size, max_num_batched_tokens=chunk_size,
                                        long_prefill_token_threshold=long_prefill_token_threshold or None,
                                        **options)
    workload.check_fits(config.max_model_len)
    cost_model.reset(0)
    with tempfile.TemporaryDirectory() as folder:
        harness = Harness(tiny_model(Path(folder)), scheduler=scheduler, max_num_batched_tokens=chunk_size,
                          max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                          block_size=config.block_size, num_blocks=config.num_blocks,
                          enable_prefix_caching=config.enable_prefix_caching, plugin_options=plugin_options,
                          long_prefill_token_threshold=long_prefill_token_threshold, **(vllm_fields or {}))
    metrics = MetricsRecorder(record_batches=record_batches)
    specs = workload.requests
    prompts = workload.prompt_token_ids(simulator.PROMPT_VOCAB) if config.enable_prefix_caching else None
    clock = [0.0]  # the simulated time: a step's start while vLLM schedules it, its end once its model has run
    timed: dict[int, tuple[SchedulerOutput, Any]] = {}  # step index -> its rows and predicted timing

    def ran(record: StepRecord) -> None:
        if record.scheduled:
            out = rows(record)
            timed[record.index] = (out, cost_model.predict(out))
            clock[0] += timed[record.index][1].step_time

    if scheduler == "plugin":  # the plugin's step timer (the "auto" budget's measurements) reads the simulated clock
        harness.scheduler.clock = lambda: clock[0]
    nxt, ready = 0, 0.0
    while nxt < len(specs) or harness.scheduler.has_requests():
        if not harness.scheduler.has_requests():
            ready = max(ready, specs[nxt].arrival_time)
        start = clock[0] = cost_model.start_time(ready)
        while nxt < len(specs) and specs[nxt].arrival_time <= start:
            spec = specs[nxt]
            harness.add(spec.request_id, prompts[nxt] if prompts else spec.prompt_len, spec.output_len,
                        arrival=spec.arrival_time)
            metrics.add(spec.request_id, spec.arrival_time, spec.prompt_len)
            nxt += 1
        record = harness.step(ran)
        if record is None or not record.scheduled:
            ready = start
            continue
        out, timing = timed.pop(record.index)
        end = start + timing.step_time
        metrics.record_step(out, start, start + timing.schedule_time, end,
                            [_Finished(rid, why) for rid, why in record.finished.items()])
        record.time = end
        ready = end
    result = simulator.bench_result(workload, cost_model, config, chunk_size, 1, metrics.stats(), wall)
    result.config.update(label=f"{label}/{chunk_size}", policy=label, vllm_version=_vllm_version())
    return result, harness, config


def simulate(workload: Workload, cost_model: CostModel, **kwargs: Any) -> BenchResult:
    """``run_on_clock``'s result alone (kwargs: as ``run_on_clock``'s)."""
    return run_on_clock(workload, cost_model, **kwargs)[0]


def replay_vllm_v1(harness: Harness, config: Any) -> list[tuple[int, dict[str, int], dict[str, int]]]:
    """Our ``vllm_v1`` policy (``config``, a ``SchedulerConfig``) replayed on the arrivals of ``harness``'s run,
    step by step: ``(step, ours, vLLM's)`` token counts of every step that scheduled anything. Each request
    is added, with the same prompt token ids (prefix caching sees the same hits), before the step vLLM first saw it
    in; every sampled token is a stand-in (``vllm_v1`` ignores it)."""
    ours = make_scheduler(dataclasses.replace(config, policy="vllm_v1"))
    arrivals: dict[int, list[str]] = {}
    for rid, index in harness.arrived.items():
        arrivals.setdefault(index, []).append(rid)
    steps = []
    for record in harness.steps:
        for rid in arrivals.get(record.index, ()):  # every request ran to its end: its outputs are its max_tokens
            ours.add(Request(rid, harness.prompts[rid], max_tokens=len(harness.tokens[rid])))
        if not record.scheduled and not ours.requests:
            continue
        out = ours.schedule()
        steps.append((record.index, {r.request_id: r.num_new_tokens for r in out.scheduled}, record.scheduled))
        ours.update(out, {r.request_id: 7 for r in out.scheduled if r.sample})
    return steps


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


# ---------------------------------------------------------------------- the CLI's route


def parse_policy(policy: str) -> str | None:
    """``"vllm@0.34"`` -> ``"0.34"``; ``None`` for any other policy name."""
    if not policy.startswith("vllm@"):
        return None
    release = policy.split("@", 1)[1]
    if not release.replace(".", "").isdigit() or release.count(".") != 1:
        raise ValueError(f"policy {policy!r}: name a vLLM release as vllm@X.Y (vllm@0.34)")
    return release


def environment_of(release: str, root: Path | None = None) -> Path:
    """The Python of the environment that holds vLLM ``release`` (scripts/setup_vllm.sh: .venv-vllm/ for 0.32;
    scripts/setup_vllm_harness.sh: .venv-vllm-X.Y/ for the others), under ``root`` (default: this checkout)."""
    root = root or Path(__file__).resolve().parents[3]
    return root / (".venv-vllm" if release == "0.32" else f".venv-vllm-{release}") / "bin" / "python"


def installed_release() -> str | None:
    """``"0.34"`` for the vLLM this interpreter imports (``None`` if none)."""
    try:
        import vllm
    except ImportError:
        return None
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


def run_policy(policy: str, workload: Workload, cost_model_spec: str, **kwargs: Any) -> BenchResult:
    """``policy`` (``vllm@X.Y``) simulated on ``workload``: here if this interpreter holds vLLM X.Y, else in the
    environment that does (``environment_of``), which must exist. kwargs: as ``simulate``'s."""
    release = parse_policy(policy)
    if release is None:
        raise ValueError(f"{policy!r} is not a vllm@X.Y policy")
    if installed_release() == release:
        return simulate(workload, load_cost_model(cost_model_spec), label=policy, **kwargs)
    python = environment_of(release)
    if not python.exists():
        raise ValueError(f"policy {policy}: no vLLM {release} here nor at {python.parent.parent} (make it with "
                         f"scripts/setup_vllm.sh for 0.32, scripts/setup_vllm_harness.sh {release}.0 otherwise)")
    with tempfile.TemporaryDirectory() as folder:
        request = Path(folder) / "request.json"
        answer = Path(folder) / "result.json"
        request.write_text(json.dumps({"policy": policy, "workload": workload.to_dict(),
                                       "cost_model": cost_model_spec, "options": kwargs}), encoding="utf-8")
        done = subprocess.run([str(python), "-m", __name__, str(request), str(answer)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"policy {policy} failed in {python}:\n{done.stderr[-3000:]}")
        return BenchResult.from_json(answer)


def main(argv: list[str] | None = None) -> int:
    """``python -m sarathi_lite.integrations.vllm.simclock REQUEST.json RESULT.json`` (``run_policy``'s other
    side): simulate the request's policy on its workload and write the ``BenchResult`` JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("request")
    parser.add_argument("result")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.request).read_text(encoding="utf-8"))
    result = simulate(Workload.from_dict(spec["workload"]), load_cost_model(spec["cost_model"]),
                      label=spec["policy"], **spec["options"])
    result.to_json(args.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

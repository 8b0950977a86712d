"""``sarathi-lite profile``: time this machine's model runner over a grid of batch shapes and fit a
``ProfiledCostModel`` that the simulator can use.

Three parts, all on one ``LLMEngine`` (needs torch and the model):

1. the grid: decode-only batches (1 to 64 decodes, varied contexts), prompt-chunk-only batches (one or two chunks
   of varied size and cached context), hybrids, and steps of several whole prompts up to 4,096 tokens (2,048
   with ``quick``; what the unchunked policies run), built directly as ``SchedulerOutput``s on the engine's KV
   pool (its contents do not matter for timing); after one warm-up run of the largest, all are run in
   ``repeats`` passes (steps above 2,048 tokens, seconds long each, in the first only) and each batch's median
   time of ``ModelRunner.execute`` counts;
2. the fit: the token curve at ``token_knots`` up to the largest batch, and the ``TERMS`` coefficients, by
   non-negative least squares on the squared relative error of each batch's median time; every fifth hybrid
   shape is held out and its error reported; the spread of the single runs around the fit becomes the model's
   jitter;
3. the calibration: a short real offline run through ``LLMEngine.step``, whose measured scheduling time, host
   time outside the forward pass (``update``) and gap between steps become the model's host overheads; its
   whole steps, predicted against measured, are reported as a second held-out check.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sarathi_lite.bench.replay import BatchShape, build_engine, machine, warm_up
from sarathi_lite.bench.results import Stopped
from sarathi_lite.costs.profiled import COST_MODEL_SCHEMA, MEASURED, TERMS, ProfiledCostModel, batch_terms
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.scheduler import Request, SchedulerConfig, SchedulerOutput, make_scheduler
from sarathi_lite.sim.cost_model import fit_profile, fit_quality, nnls

logger = logging.getLogger(__name__)

HOLDOUT_EVERY = 5
# Steps above this many tokens last seconds each on a CPU: timed in one pass only (time_outputs).
LONG_STEP_TOKENS = 2048
JITTER_QUANTILES = 21  # every 5th percentile
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# The calibration run's chunk size: part of the profiling method (its batches mix chunks and decodes like a
# serving run's), not an engine option, so the same profile comes out whatever the engine's default.
CALIBRATION_CHUNK_SIZE = 128


def profile_grid(*, max_tokens: int = 512, max_context: int = 1024, max_decodes: int = 64, quick: bool = False,
                 max_step_tokens: int | None = None, seed: int = 0) -> list[BatchShape]:
    """Batch shapes covering what serving runs up to ``max_tokens`` tokens per step, ``max_context`` cached
    tokens per request and ``max_decodes`` decodes, in a seeded random order: decode-only batches (twice each
    ``token_knots`` size up to ``max_decodes``, contexts drawn up to a small, medium or full cap), chunk-only
    batches (each knot from 16 to ``max_tokens``, as one chunk and as two; cached context 0 or drawn) and hybrids
    (twice per knot: a random number of decodes plus one or two chunks filling it); then the whole-prompt steps
    (``whole_prompt_shapes``) up to ``max_step_tokens`` (default ``8 * max_tokens``, 4,096: the steps the
    default ``sarathi-lite sim`` workload asks of the unchunked policies, about 3,000 tokens, are measured, not
    extrapolated; with ``quick``, ``4 * max_tokens``, 2,048, vLLM's default budget for a step of whole prompts).

    quick (for a notebook or CI): fewer shapes, but the same corners, placed rather than drawn, since with about
    as many shapes as fitted values a random draw that misses a corner leaves its term to extrapolation: decode-only
    sizes once (contexts alternately small and full); each chunk size once at no cached context (not sampling,
    as a prompt's first chunks) and, at the powers of two, once more after ``max_context`` cached tokens
    (sampling; long-context chunks pin the attention term); hybrids once per knot, each with as many decodes as
    fit (up to ``max_decodes``, at full context) beside one chunk after ``max_context`` cached tokens (many
    decodes pin the decode terms)."""
    rng = np.random.default_rng(seed)
    caps = (max(max_context // 16, 1), max(max_context // 4, 1), max_context)
    budgets = [b for b in token_knots(max_tokens) if b >= 16]
    if max_step_tokens is None:
        max_step_tokens = (4 if quick else 8) * max_tokens
    whole = whole_prompt_shapes(max_tokens, max_step_tokens, quick)
    if quick:
        shapes = _quick_grid(budgets, max_context, max_decodes, caps, rng) + whole
        return [shapes[i] for i in rng.permutation(len(shapes))]

    def contexts(n: int) -> tuple[int, ...]:
        return tuple(int(c) for c in rng.integers(1, caps[rng.integers(3)] + 1, n))

    def chunk(new: int) -> tuple[int, int, bool]:
        computed = 0 if rng.random() < 0.4 else int(rng.integers(1, max_context + 1))
        return computed, new, bool(rng.random() < 0.5)

    shapes = [BatchShape(contexts(n)) for n in token_knots(max_decodes) for _ in range(2)]
    shapes += [BatchShape((), (chunk(b),)) for b in budgets]
    shapes += [BatchShape((), (chunk(b // 2), chunk(b - b // 2))) for b in budgets]
    for budget in budgets * 2:
        n = int(rng.integers(1, min(max_decodes, budget - 1) + 1))
        rest = budget - n
        parts = (chunk(rest),) if rng.random() < 0.7 or rest < 2 else (chunk(rest // 2), chunk(rest - rest // 2))
        shapes.append(BatchShape(contexts(n), parts))
    shapes += whole
    return [shapes[i] for i in rng.permutation(len(shapes))]


def whole_prompt_shapes(max_tokens: int, max_step_tokens: int, quick: bool = False) -> list[BatchShape]:
    """The steps of the unchunked policies (``vllm``, ``orca``): several whole prompts at once (no cached
    context, each sampling), thousands of tokens, beyond the chunked grid's ``max_tokens``. At each size from
    ``2 * max_tokens`` doubling up to ``max_step_tokens`` (and ``max_step_tokens`` itself): prompts of
    ``2 * max_tokens`` tokens (a long prompt; one at the smallest size), and prompts of ``max_tokens // 2``
    (several short ones); the full grid adds prompts of ``max_tokens``. Two prompt counts at one size pin the
    token curve there apart from the per-chunk and per-sample terms, which no chunked shape (one or two chunks)
    separates. Empty when ``max_step_tokens <= max_tokens``."""
    sizes = []
    size = 2 * max_tokens
    while size < max_step_tokens:
        sizes.append(size)
        size *= 2
    if max_step_tokens > max_tokens:
        sizes.append(max_step_tokens)
    lengths = (2 * max_tokens, max(max_tokens // 2, 1)) if quick else (2 * max_tokens, max_tokens,
                                                                        max(max_tokens // 2, 1))
    shapes = []
    for size in sizes:
        for length in sorted({min(length, size) for length in lengths}, reverse=True):
            n, rest = divmod(size, length)
            prompts = [length] * n + ([rest] if rest else [])
            shapes.append(BatchShape((), tuple((0, p, True) for p in prompts)))
    return shapes


def _quick_grid(budgets: Sequence[int], max_context: int, max_decodes: int, caps: Sequence[int],
                rng: np.random.Generator) -> list[BatchShape]:
    """``profile_grid(quick=True)``'s chunked shapes (contexts drawn from ``rng``)."""
    def contexts(n: int, cap: int) -> tuple[int, ...]:
        return tuple(int(c) for c in rng.integers(max(cap // 2, 1), cap + 1, n))

    shapes = [BatchShape(contexts(n, caps[2] if i % 2 else caps[0]))
              for i, n in enumerate(token_knots(max_decodes))]
    shapes += [BatchShape((), ((0, b, False),)) for b in budgets]
    shapes += [BatchShape((), ((max_context, b, True),)) for b in budgets if b & (b - 1) == 0]
    for i, budget in enumerate(budgets):
        n = min(max_decodes, budget // 2)
        shapes.append(BatchShape(contexts(n, max_context), ((max_context, budget - n, bool(i % 2)),)))
    return shapes


def token_knots(limit: int) -> list[int]:
    """Batch sizes (tokens) up to ``limit`` where the token curve is measured: 1, 2, 3, then powers of two and
    the midpoints 1.5 times them (4, 6, 8, 12, 16, 24, ...), and ``limit`` itself. CPU BLAS libraries switch
    kernels at small batch sizes (docs/guides/simulator.md shows where), so the small sizes are all knots."""
    out = sorted({n for k in range(limit.bit_length()) for n in (2 ** k, 3 * 2 ** k // 2) if 1 <= n <= limit})
    return out if out[-1] == limit else out + [limit]


def time_outputs(engine: LLMEngine, outputs: Sequence[SchedulerOutput], *, repeats: int = 3,
                 progress: bool = True, once_above: int = LONG_STEP_TOKENS) -> list[list[float]]:
    """Seconds of ``engine.runner.execute`` per batch (``repeats`` runs each; one for a batch of more than
    ``once_above`` tokens, which lasts seconds, so one run's noise is small against it), timed in ``repeats``
    passes through all of them after one warm-up run of the largest batch (which sizes the attention backend's
    buffers). Passes rather than back-to-back repeats: a slow spell of a shared machine then hits one run of
    several batches instead of every run of one. Stopped early (``KeyboardInterrupt``), raises ``Stopped`` with
    the runs so far (per batch, possibly none)."""
    if engine.has_unfinished_requests():
        raise ValueError("profiling needs an idle engine (it writes into the KV pool)")

    def run(out: SchedulerOutput) -> float:
        t0 = time.perf_counter()
        engine.runner.execute(out, {s.request_id: GREEDY for s in out.scheduled if s.sample})
        return time.perf_counter() - t0

    run(max(outputs, key=lambda o: (o.num_batched_tokens, len(o.scheduled))))
    timed = [[i for i, out in enumerate(outputs) if k == 0 or out.num_batched_tokens <= once_above]
             for k in range(repeats)]
    runs: list[list[float]] = [[] for _ in outputs]
    with tqdm(total=sum(map(len, timed)), desc="profile", unit="batch", leave=False, disable=not progress) as bar:
        try:
            for batch in timed:
                for i in batch:
                    runs[i].append(run(outputs[i]))
                    bar.update(1)
        except KeyboardInterrupt:
            raise Stopped(runs, f"{bar.n} of {bar.total} timed runs") from None
    return runs


@dataclass(slots=True)
class Calibration:
    """Per-iteration records of a real run through ``LLMEngine.step``: its outputs, the measured step and
    scheduling times, the model runner's time inside each step, and the gaps between steps (seconds)."""

    outputs: list[SchedulerOutput]
    step_times: list[float]
    schedule_times: list[float]
    forward_times: list[float]
    gaps: list[float]


def calibrate(engine: LLMEngine, *, num_requests: int = 8, seed: int = 0) -> Calibration:
    """Run ``num_requests`` requests (prompts 16-160 tokens, outputs 4-16, all at once) through the engine; the
    iteration records give each step's times and the model runner's share (``IterationRecord.execute_time``).
    The batches themselves come from the same requests through a fresh scheduler of the engine's config, which
    decides exactly as the engine's did (it sees the same requests and tokens, and no clock)."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    requests = []
    for i in range(num_requests):
        prompt = rng.integers(100 if vocab > 200 else 0, vocab, int(rng.integers(16, 161))).tolist()
        requests.append((f"calibrate-{i}", prompt, int(rng.integers(4, 17))))
    engine.reset_stats()
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
    sampled: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                sampled[o.request_id] = list(o.token_ids)
    its = engine.stats().iterations
    engine.reset_stats()
    outputs = scheduled_batches(engine.scheduler_config, requests, sampled)
    if [(o.num_prefill_tokens, o.num_decode_tokens) for o in outputs] != [
            (it.num_prefill_tokens, it.num_decode_tokens) for it in its]:
        raise RuntimeError("calibration: the scheduler's replay does not match the engine's iterations")
    return Calibration(outputs, [it.step_time for it in its], [it.schedule_time for it in its],
                       [it.execute_time for it in its], [b.start_time - a.end_time for a, b in zip(its, its[1:])])


def scheduled_batches(config: SchedulerConfig, requests: Sequence[tuple[str, list[int], int]],
                      sampled: dict[str, list[int]]) -> list[SchedulerOutput]:
    """The non-empty ``SchedulerOutput``s a scheduler of ``config`` makes for ``requests`` (``(request_id,
    prompt token ids, max_tokens)``, all arriving at once, no stop tokens) when each samples the tokens in
    ``sampled[request_id]``, in order."""
    scheduler = make_scheduler(config)
    for rid, prompt, max_tokens in requests:
        scheduler.add(Request(rid, prompt, max_tokens, frozenset(), 0.0))
    taken = dict.fromkeys(sampled, 0)
    outputs = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        tokens = {}
        for s in out.scheduled:
            if s.sample:
                tokens[s.request_id] = sampled[s.request_id][taken[s.request_id]]
                taken[s.request_id] += 1
        scheduler.update(out, tokens)
        if out.scheduled:
            outputs.append(out)
    return outputs


def holdout(shapes: Sequence[BatchShape]) -> np.ndarray:
    """Every ``HOLDOUT_EVERY``-th hybrid shape (decodes and chunks together, as serving runs them): held out of
    the fit to measure its error. The decode-only and chunk-only shapes all stay in, since they alone pin down the
    token curve at small and large batches."""
    hybrid = np.array([bool(s.decode_contexts and s.chunks) for s in shapes])
    return hybrid & (np.cumsum(hybrid) % HOLDOUT_EVERY == 0)


def fit_cost_model(terms: Sequence[Sequence[float]], runs: Sequence[Sequence[float]], held: np.ndarray,
                   knots: Sequence[int], calibration: Calibration) -> tuple[ProfiledCostModel, dict[str, Any]]:
    """Fit the forward pass (token curve at ``knots``, ``TERMS``) to the median of each batch's ``runs`` for
    the batches not ``held`` out, the host overheads on ``calibration``, and the jitter to every training run over
    its prediction (``JITTER_QUANTILES`` quantiles); returns the model and its fit quality (training shapes,
    held-out shapes, the calibration's whole engine steps; all of the typical step, without jitter)."""
    a = np.asarray(terms, dtype=np.float64)
    y = np.array([statistics.median(r) for r in runs])
    forward = ProfiledCostModel(knots, *fit_profile(a[~held], y[~held], knots))
    predicted = forward.forward_time(a)
    quality: dict[str, Any] = {"train": fit_quality(predicted[~held], y[~held]),
                               "held_out": fit_quality(predicted[held], y[held]) if held.any() else None}
    rows = np.array([[1.0, len(o.scheduled)] for o in calibration.outputs])
    sched = nnls(rows, np.asarray(calibration.schedule_times))
    # host time of a step outside schedule() and the forward pass (update, bookkeeping): per step, per request
    rest = np.asarray(calibration.step_times) - np.asarray(calibration.schedule_times) - \
        np.asarray(calibration.forward_times)
    host = nnls(rows, np.maximum(rest, 0.0))
    coefficients = dict(forward.coefficients)
    coefficients["decode_tokens"] += float(host[1])
    coefficients["prefill_chunks"] += float(host[1])
    model = ProfiledCostModel(knots, [t + float(host[0]) for t in forward.token_times], coefficients,
                              schedule_constant=float(sched[0]), schedule_per_request=float(sched[1]),
                              step_gap=float(np.median(calibration.gaps)) if calibration.gaps else 0.0)
    warn_degenerate(forward.coefficients)
    quality["engine_steps"] = fit_quality([model.predict(o).step_time for o in calibration.outputs],
                                          calibration.step_times)
    ratios = [t / p for r, p, h in zip(runs, predicted, held) if not h for t in r]
    return dataclasses.replace(model, jitter=np.quantile(ratios, np.linspace(0, 1, JITTER_QUANTILES))), quality


def warn_degenerate(coefficients: dict[str, float]) -> list[str]:
    """The ``TERMS`` the forward fit left at no cost (non-negative least squares clipped them at 0), each a
    ``UserWarning``: the grid's timings could not tell that work apart (often a machine busy with other work),
    and the simulator would price it at nothing."""
    zero = [t for t in TERMS if coefficients.get(t, 0.0) <= 0.0]
    if zero:
        warnings.warn(f"the profile's fit gave {', '.join(zero)} no cost (the timings could not separate "
                      f"{'them' if len(zero) > 1 else 'it'}; the simulator would price that work at nothing): "
                      f"profile again on a quieter machine with one torch thread and more repeats (sarathi-lite "
                      f"profile --threads 1 --repeats 5, or torch.set_num_threads(1) and profile(..., repeats=5))",
                      stacklevel=2)
    return zero


def grid_outputs(engine: LLMEngine, shapes: Sequence[BatchShape], seed: int = 0) -> list[SchedulerOutput]:
    """The grid's batches as ``SchedulerOutput``s on ``engine``'s KV pool (random token ids, seeded)."""
    cfg = engine.scheduler_config
    rng = np.random.default_rng(seed)
    return [s.output(cfg.block_size, cfg.num_blocks, engine.model_config.vocab_size, rng) for s in shapes]


def grid_knots(terms: Sequence[Sequence[float]], max_tokens: int) -> list[int]:
    """The ``token_knots`` up to ``max_tokens`` that some batch (a row of ``batch_terms`` values) measured
    exactly: where the fitted token curve takes its values."""
    return sorted(set(token_knots(max_tokens)) & {t[0] for t in terms})


def measured_range(terms: Sequence[Sequence[float]]) -> dict[str, float]:
    """``ProfiledCostModel.measured`` of a grid: the largest of each of ``MEASURED`` over its rows of
    ``batch_terms`` values."""
    columns = dict(zip(("tokens", *TERMS), zip(*terms)))
    return {k: float(max(columns[k])) for k in MEASURED}


def fit_grid(engine: LLMEngine, shapes: Sequence[BatchShape], terms: Sequence[Sequence[float]],
             runs: Sequence[Sequence[float]], calibration: Calibration, max_tokens: int
             ) -> tuple[ProfiledCostModel, dict[str, Any]]:
    """``fit_cost_model`` on one grid's timed batches (``terms``: each batch's ``batch_terms``; ``runs``: seconds
    of its repeats), with knots up to the larger of ``max_tokens`` and the grid's largest step, the measured
    range, and the engine's KV pool and context length recorded in the model (the simulator sizes its pool
    from them)."""
    limit = max(max_tokens, *(int(t[0]) for t in terms))
    cost, quality = fit_cost_model(terms, runs, holdout(shapes), grid_knots(terms, limit), calibration)
    cost.measured = measured_range(terms)
    cfg = engine.scheduler_config
    per_token = engine.model_config.kv_bytes_per_token(engine.dtype.itemsize)
    cost.kv_bytes_per_token = per_token
    cost.kv_cache_memory = cfg.num_blocks * cfg.block_size * per_token
    cost.max_position_embeddings = engine.model_config.max_position_embeddings
    return cost, quality


def profile(model: str | Path | None = None, *, quick: bool = False, repeats: int = 3, max_tokens: int = 512,
            max_context: int = 1024, max_decodes: int = 64, max_step_tokens: int | None = None, seed: int = 0,
            progress: bool = True, engine: LLMEngine | None = None, **engine_options: Any) -> ProfiledCostModel:
    """Profile ``model`` (or ``engine``'s loaded weights) on this machine and return the fitted cost model.

    quick, max_tokens, max_context, max_decodes, max_step_tokens, seed: the grid (``profile_grid``). repeats:
    timed runs per shape (the median counts). engine_options: as for ``LLMEngine`` (``dtype``, ``device``,
    ``block_size``, ``num_kv_blocks``, ...); the simulator later derives the same KV pool from the saved model.
    Stopped early (``KeyboardInterrupt``) while timing or calibrating, raises ``Stopped`` with the
    ``partial_profile`` of the timings so far (``None`` if there are none).
    """
    wall = time.perf_counter()
    load_start = os.getloadavg()
    engine = build_engine(model, "sarathi", CALIBRATION_CHUNK_SIZE, engine, **engine_options)
    warm_up(engine)
    shapes = profile_grid(max_tokens=max_tokens, max_context=max_context, max_decodes=max_decodes, quick=quick,
                          max_step_tokens=max_step_tokens, seed=seed)
    outputs = grid_outputs(engine, shapes, seed)
    terms = [batch_terms(o) for o in outputs]
    grid = {"shapes": len(shapes), "repeats": repeats, "max_tokens": max_tokens, "max_context": max_context,
            "max_decodes": max_decodes, "max_step_tokens": max(int(t[0]) for t in terms), "quick": quick,
            "seed": seed}

    def meta(runs: Sequence[Sequence[float]]) -> dict[str, Any]:
        return {"model": engine.model_path.name, "dtype": str(engine.dtype).removeprefix("torch."),
                "device": str(engine.device), "attention_backend": engine.runner.attention_backend,
                "machine": machine(), "threads": torch.get_num_threads(),
                "date": datetime.datetime.now().isoformat(timespec="seconds"), "load_average_start": list(load_start),
                "load_average_end": list(os.getloadavg()), "wall_time": time.perf_counter() - wall, "grid": grid,
                "samples": [{"terms": dict(zip(("tokens", *TERMS), t)), "runs": list(r)}
                            for t, r in zip(terms, runs) if r]}

    runs: list[list[float]] = []
    try:
        runs = time_outputs(engine, outputs, repeats=repeats, progress=progress)
        calibration = calibrate(engine, seed=seed)
    except KeyboardInterrupt as stop:
        runs = stop.partial if isinstance(stop, Stopped) else runs
        progress_text = stop.progress if isinstance(stop, Stopped) else "all timed runs, calibration stopped"
        raise Stopped(partial_profile(meta(runs), progress_text) if any(runs) else None, progress_text) from None
    cost, quality = fit_grid(engine, shapes, terms, runs, calibration, max_tokens)
    cost.meta = {**meta(runs), "fit": quality}
    return cost


def partial_profile(meta: dict[str, Any], progress: str) -> dict[str, Any]:
    """What a stopped ``profile`` saves: the raw timings measured so far (``meta["samples"]``) and how far it got,
    marked ``"partial"``. Not a cost model: ``ProfiledCostModel.load`` refuses it (a grid cut short misses some
    corners at random, and the host overheads come from the calibration run after the grid)."""
    return {"schema": COST_MODEL_SCHEMA, "kind": "profiled", "partial": progress, "meta": meta}


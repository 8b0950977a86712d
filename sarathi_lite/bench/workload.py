"""What a serving benchmark replays: requests with an arrival time, a prompt length and an output length.

Pure Python + numpy (never torch), so the real-time replay and a simulator build the very same workload from the
same description and seed.

Constructors:

- ``Workload.from_trace(path, ...)``: lengths from a trace CSV (``num_prefill_tokens``, ``num_decode_tokens``),
  arrivals from its ``arrived_at`` column (seconds) multiplied by ``time_scale``, or Poisson at ``qps``;
- ``Workload.synthetic(lengths, ...)``: lengths ``fixed:P:O``, ``uniform:PMIN-PMAX:OMIN-OMAX`` or
  ``zipf:PMIN-PMAX:OMIN-OMAX[:THETA]``, Poisson arrivals at ``qps`` (or all at time 0 without one);
- ``Workload.conversations(trace, ...)``: multi-turn chats with lengths from a trace, turn k resending turns
  1 .. k-1 (user messages and replies) before its own message, so each turn's prompt extends the previous one's;
- ``workload.with_system_prompt(n)``: the same requests, each prompt starting with one shared n-token prompt;
- ``workload.at_qps(qps)``: the same requests with Poisson arrivals at another rate (capacity search);
- ``workload.with_long_prompts(num_long, prompt_len)``: long-context traffic, a few very long prompts among the
  others (``Workload.synthetic("uniform:100-600:50-250", ...).with_long_prompts(10, 60_000)``; on a trace,
  ``from_trace(..., max_prompt=None)`` keeps its own long tail).

Shared prompt content (for prefix caching) is described by each request's ``segments``: named token runs at the
start of its prompt; a segment name always stands for the same tokens, in every request, process and run.

Lengths are scaled first (``round(n * scale)``, at least 1), then clipped (``max_prompt``, ``max_output``).
Every random draw comes from ``seed``: Poisson inter-arrival times are drawn once at rate 1 and divided by the
rate, so two rates of one seed differ only by a time scale. ``prompt_token_ids`` draws each segment's tokens
from ``(seed, segment name)`` and the rest of a request's prompt from ``(seed, request id)`` alone, so a
request's prompt does not depend on the other requests.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.traces import trace_label, trace_path

logger = logging.getLogger(__name__)

_ARRIVALS_STREAM = 1
_LENGTHS_STREAM = 2
_PROMPTS_STREAM = 3
_SEGMENTS_STREAM = 4
_LONG_STREAM = 5


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request to replay: ``arrival_time`` in seconds after the start of the run, lengths in tokens.

    The output is forced to ``output_len`` tokens (EOS ignored). ``segments``: ``(name, num_tokens)`` runs of
    shared tokens the prompt starts with, in order (at most ``prompt_len`` in all); the rest is its own."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    segments: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.arrival_time >= 0:
            raise ValueError(f"request {self.request_id!r}: arrival_time={self.arrival_time!r} must be >= 0")
        for name in ("prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"request {self.request_id!r}: {name}={getattr(self, name)!r} must be >= 1")
        shared = sum(n for _, n in self.segments)
        if shared > self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: segments of {shared} tokens exceed "
                             f"prompt_len={self.prompt_len}")


@dataclass(slots=True, frozen=True)
class Workload:
    """Requests sorted by arrival time, how they were made (``source``), and the ``seed`` of every draw."""

    requests: tuple[RequestSpec, ...]
    source: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        for a, b in zip(self.requests, self.requests[1:]):
            if b.arrival_time < a.arrival_time:
                raise ValueError(f"requests must be sorted by arrival_time: {b.request_id!r} "
                                 f"({b.arrival_time}) comes after {a.request_id!r} ({a.arrival_time})")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"request ids must be unique; repeated: {', '.join(map(repr, dup))}")
        lengths: dict[str, int] = {}
        for r in self.requests:
            for name, n in r.segments:
                if lengths.setdefault(name, n) != n:
                    raise ValueError(f"segment {name!r} has two lengths: {lengths[name]} and {n}")

    def __len__(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_trace(cls, trace: str | Path = "conversation", *, num_requests: int | None = None, start: int = 0,
                   qps: float | None = None, time_scale: float = 1.0, prompt_scale: float = 1.0,
                   output_scale: float = 1.0, max_prompt: int | None = None, max_output: int | None = None,
                   seed: int = 0) -> Workload:
        """Rows ``start .. start + num_requests`` of a trace (all rows from ``start`` when ``None``).

        trace: a built-in trace name (``"conversation"``, ``"arxiv"``; see ``sarathi_lite.bench.traces``) or the
            path of a CSV with the columns ``num_prefill_tokens``, ``num_decode_tokens`` (``arrived_at`` optional).

        qps: Poisson arrivals at this rate (requests/s). Without it, the trace's ``arrived_at`` times (seconds,
            made relative to the first row taken) times ``time_scale`` (2 halves the rate); a trace without
            arrival times then has every request arrive at time 0.
        prompt_scale, output_scale, max_prompt, max_output: scale, then clip, each length (tokens).
        """
        path = trace_path(trace)
        rows, has_times = _read_trace(path, start, num_requests)
        _check_positive("time_scale", time_scale)
        prompts = _scale_clip([int(r["num_prefill_tokens"]) for r in rows], prompt_scale, max_prompt, "prompt")
        outputs = _scale_clip([int(r["num_decode_tokens"]) for r in rows], output_scale, max_output, "output")
        if qps is not None:
            arrivals = poisson_arrivals(len(rows), qps, seed)
        elif has_times:
            t = np.array([float(r["arrived_at"]) for r in rows])
            arrivals = np.maximum(t - t[0], 0.0) * time_scale
        else:
            logger.info("%s has no arrival times and no qps was given: every request arrives at time 0", path.name)
            arrivals = np.zeros(len(rows))
        source = {"kind": "trace", "trace": trace_label(trace), "start": start, "num_requests": len(rows),
                  "arrivals": "poisson" if qps is not None else ("trace" if has_times else "offline"),
                  "qps": qps, "time_scale": time_scale, "prompt_scale": prompt_scale,
                  "output_scale": output_scale, "max_prompt": max_prompt, "max_output": max_output}
        return cls._build(arrivals, prompts, outputs, source, seed)

    @classmethod
    def synthetic(cls, lengths: str, *, num_requests: int, qps: float | None = None, max_prompt: int | None = None,
                  max_output: int | None = None, seed: int = 0) -> Workload:
        """``num_requests`` requests with lengths drawn from ``lengths`` (see ``parse_lengths``), Poisson arrivals
        at ``qps`` requests/s, or all at time 0 when ``qps`` is ``None``."""
        _check_positive("num_requests", num_requests)
        rng = np.random.default_rng([seed, _LENGTHS_STREAM])
        prompts, outputs = sample_lengths(parse_lengths(lengths), num_requests, rng)
        prompts = _scale_clip(prompts, 1.0, max_prompt, "prompt")
        outputs = _scale_clip(outputs, 1.0, max_output, "output")
        arrivals = np.zeros(num_requests) if qps is None else poisson_arrivals(num_requests, qps, seed)
        source = {"kind": "synthetic", "lengths": lengths, "num_requests": num_requests,
                  "arrivals": "offline" if qps is None else "poisson", "qps": qps, "max_prompt": max_prompt,
                  "max_output": max_output}
        return cls._build(arrivals, prompts, outputs, source, seed)

    @classmethod
    def conversations(cls, trace: str | Path = "conversation", *, num_conversations: int, turns: int = 4,
                      system_prompt: int = 0, qps: float | None = None, turn_gap: float = 10.0, start: int = 0,
                      prompt_scale: float = 1.0, output_scale: float = 1.0, max_prompt: int | None = None,
                      max_output: int | None = None, seed: int = 0) -> Workload:
        """``num_conversations`` chats of ``turns`` turns each, lengths from consecutive trace rows (one row per
        turn: ``num_prefill_tokens`` is the user's new message, ``num_decode_tokens`` the reply).

        Turn k's prompt is the shared ``system_prompt`` (tokens), then the user messages and replies of turns
        1 .. k-1, then message k, all as segments, so it extends turn k-1's prompt. A resent reply is a fixed
        run of tokens of the reply's length, not what the model generated (the replay forces lengths, not
        content): the cache can serve turn k everything of turn k-1's prompt, never its generated reply.
        Conversation c starts at a Poisson arrival at ``qps`` conversations/s (all at 0 without), and its turn
        k arrives ``(k - 1) * turn_gap`` seconds later. prompt_scale, max_prompt: scale, then clip, each
        message; output_scale, max_output: each reply. Request ids: ``conv-C-turn-K`` (K from 1).
        """
        _check_positive("num_conversations", num_conversations)
        _check_positive("turns", turns)
        if turn_gap < 0:
            raise ValueError(f"turn_gap={turn_gap!r} must be >= 0")
        rows, _ = _read_trace(trace_path(trace), start, num_conversations * turns)
        messages = _scale_clip([int(r["num_prefill_tokens"]) for r in rows], prompt_scale, max_prompt, "prompt")
        replies = _scale_clip([int(r["num_decode_tokens"]) for r in rows], output_scale, max_output, "output")
        starts = np.zeros(num_conversations) if qps is None else poisson_arrivals(num_conversations, qps, seed)
        width = len(str(num_conversations - 1))
        specs = []
        for c in range(num_conversations):
            history: list[tuple[str, int]] = []
            for k in range(turns):
                i = c * turns + k
                conv = f"conv-{c:0{width}d}"
                segments = (*history, (f"{conv}/user-{k + 1}", messages[i]))
                specs.append(RequestSpec(f"{conv}-turn-{k + 1}", float(starts[c] + k * turn_gap),
                                         sum(n for _, n in segments), replies[i], segments))
                history = [*segments, (f"{conv}/reply-{k + 1}", replies[i])]
        specs.sort(key=lambda r: (r.arrival_time, r.request_id))
        source = {"kind": "conversations", "trace": trace_label(trace), "start": start,
                  "num_conversations": num_conversations, "turns": turns, "turn_gap": turn_gap,
                  "arrivals": "offline" if qps is None else "poisson", "qps": qps, "prompt_scale": prompt_scale,
                  "output_scale": output_scale, "max_prompt": max_prompt, "max_output": max_output}
        workload = cls(tuple(specs), source, seed)
        return workload.with_system_prompt(system_prompt) if system_prompt else workload

    def with_system_prompt(self, num_tokens: int) -> Workload:
        """The same requests, each prompt ``num_tokens`` longer: one shared system prompt in front."""
        _check_positive("num_tokens", num_tokens)
        specs = tuple(replace(r, prompt_len=r.prompt_len + num_tokens, segments=(("system", num_tokens),
                                                                                 *r.segments))
                      for r in self.requests)
        return Workload(specs, {**self.source, "system_prompt": num_tokens}, self.seed)

    @classmethod
    def _build(cls, arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
               source: dict[str, Any], seed: int) -> Workload:
        order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
        width = len(str(max(len(prompts) - 1, 0)))
        specs = tuple(RequestSpec(f"req-{i:0{width}d}", float(arrivals[i]), int(prompts[i]), int(outputs[i]))
                      for i in order)
        return cls(specs, source, seed)

    def at_qps(self, qps: float) -> Workload:
        """The same requests (ids, lengths, order) with Poisson arrivals at ``qps`` requests/s from this seed."""
        arrivals = poisson_arrivals(len(self.requests), qps, self.seed)
        specs = tuple(replace(r, arrival_time=float(t)) for r, t in zip(self.requests, arrivals))
        return Workload(specs, {**self.source, "arrivals": "poisson", "qps": qps}, self.seed)

    def with_long_prompts(self, num_long: int, prompt_len: int, output_len: int | None = None) -> Workload:
        """Long-context traffic: the same requests (ids, arrivals, order), but ``num_long`` of them, drawn from
        the seed, get a ``prompt_len``-token prompt (and ``output_len`` output tokens, default their own).
        The head-of-line case: short requests arriving while a very long prompt is prefilled. Raises
        ``ValueError`` for a count outside ``[1, len(self)]`` or a non-positive length."""
        if isinstance(num_long, bool) or not isinstance(num_long, int) or not 1 <= num_long <= len(self.requests):
            raise ValueError(f"num_long={num_long!r} must be an integer in [1, {len(self.requests)}]")
        for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        rng = np.random.default_rng([self.seed, _LONG_STREAM])
        chosen = set(rng.choice(len(self.requests), num_long, replace=False).tolist())
        specs = tuple(replace(r, prompt_len=prompt_len, output_len=output_len or r.output_len) if i in chosen else r
                      for i, r in enumerate(self.requests))
        source = {**self.source, "long_prompts": {"num_long": num_long, "prompt_len": prompt_len,
                                                  "output_len": output_len}}
        return Workload(specs, source, self.seed)

    def long_request_ids(self, threshold: int) -> set[str]:
        """Ids of the requests whose prompt has more than ``threshold`` tokens."""
        return {r.request_id for r in self.requests if r.prompt_len > threshold}

    # ------------------------------------------------------------------ use

    def check_fits(self, max_model_len: int) -> None:
        """Raise ``ValueError`` if a request's prompt plus output exceeds ``max_model_len`` tokens."""
        too_long = [r.request_id for r in self.requests if r.prompt_len + r.output_len > max_model_len]
        if too_long:
            raise ValueError(f"{len(too_long)} request(s) (e.g. {too_long[0]}) need more than max_model_len="
                             f"{max_model_len} tokens; clip the workload (max_prompt, max_output)")

    def prompt_token_ids(self, vocab_size: int, first_id: int = 100) -> list[list[int]]:
        """One prompt per request (in ``requests`` order): ``prompt_len`` token ids drawn uniformly from
        ``[first_id, vocab_size)`` with the seed (ids below ``first_id``, special tokens in most vocabularies,
        are never drawn; ``first_id`` drops to 0 for vocabularies of at most ``2 * first_id`` ids): first each
        segment's tokens (the same wherever the segment appears), then the request's own."""
        low = first_id if vocab_size > 2 * first_id else 0

        def draw(stream: int, name: str, n: int) -> list[int]:
            return np.random.default_rng([self.seed, stream, zlib.crc32(name.encode())]).integers(
                low, vocab_size, n).tolist()

        segments: dict[str, list[int]] = {}
        prompts = []
        for r in self.requests:
            prompt: list[int] = []
            for name, n in r.segments:
                if name not in segments:
                    segments[name] = draw(_SEGMENTS_STREAM, name, n)
                prompt += segments[name]
            prompts.append(prompt + draw(_PROMPTS_STREAM, r.request_id, r.prompt_len - len(prompt)))
        return prompts

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0

    @property
    def qps(self) -> float | None:
        """Mean arrival rate (requests/s) over the arrival span; ``None`` when all arrive at once."""
        return (len(self.requests) - 1) / self.duration if self.duration > 0 else None

    def describe(self) -> str:
        """One line: counts, mean lengths, rate."""
        p = [r.prompt_len for r in self.requests]
        o = [r.output_len for r in self.requests]
        rate = "all at t=0" if self.qps is None else f"{self.qps:.2f} req/s over {self.duration:.0f} s"
        origin = Path(self.source["trace"]).name if "trace" in self.source else self.source.get("lengths")
        return (f"{len(self.requests)} requests ({origin}), "
                f"prompt mean {np.mean(p):.0f} / max {max(p)} tokens, output mean {np.mean(o):.0f} / max {max(o)} "
                f"tokens, {rate}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``source``, ``seed`` and the requests as columns."""
        rs = self.requests
        cols: dict[str, list[Any]] = {
            "request_id": [r.request_id for r in rs], "arrival_time": [r.arrival_time for r in rs],
            "prompt_len": [r.prompt_len for r in rs], "output_len": [r.output_len for r in rs]}
        if any(r.segments for r in rs):
            cols["segments"] = [[list(s) for s in r.segments] for r in rs]
        return {"source": dict(self.source), "seed": self.seed, "requests": cols}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        cols = d["requests"]
        segments = cols.get("segments") or [()] * len(cols["request_id"])
        specs = tuple(RequestSpec(*row, tuple((str(name), int(n)) for name, n in segs))
                      for *row, segs in zip(cols["request_id"], cols["arrival_time"], cols["prompt_len"],
                                            cols["output_len"], segments))
        return cls(specs, dict(d.get("source", {})), int(d.get("seed", 0)))


# ---------------------------------------------------------------------- building blocks


def _read_trace(path: Path, start: int, num_requests: int | None) -> tuple[list[dict[str, str]], bool]:
    """Rows ``start .. start + num_requests`` of a trace CSV (all from ``start`` for ``None``) and whether it
    has arrival times. Raises ``ValueError`` naming the file for one that is not a text CSV, missing columns or
    too few rows."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"num_prefill_tokens", "num_decode_tokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: trace has no column(s) {', '.join(sorted(missing))}")
            has_times = "arrived_at" in (reader.fieldnames or ())
            stop = None if num_requests is None else start + num_requests
            rows = list(itertools.islice(reader, start, stop))
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: not a trace CSV (UTF-8 text with columns num_prefill_tokens, "
                         f"num_decode_tokens): {e}") from None
    if not rows:
        raise ValueError(f"{path}: no rows from row {start}")
    if num_requests is not None and len(rows) < num_requests:
        raise ValueError(f"{path}: asked for {num_requests} rows from row {start}, the trace has {len(rows)}")
    return rows, has_times


def poisson_arrivals(n: int, qps: float, seed: int) -> np.ndarray:
    """``n`` arrival times (seconds, the first at 0) of a Poisson process at ``qps`` requests/s: the unit-rate
    gaps drawn from ``seed`` divided by ``qps``."""
    _check_positive("qps", qps)
    gaps = np.random.default_rng([seed, _ARRIVALS_STREAM]).exponential(1.0, n)
    times = np.cumsum(gaps) - gaps[0] if n else gaps
    return times / qps


@dataclass(slots=True, frozen=True)
class LengthDistribution:
    """Prompt and output lengths (tokens): ``kind`` ``fixed`` (``prompt[0]``, ``output[0]``), ``uniform`` over
    ``[lo, hi]`` inclusive, or ``zipf`` (P(n) proportional to ``n ** -theta`` on ``[lo, hi]``)."""

    kind: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    theta: float = 1.0


def parse_lengths(text: str) -> LengthDistribution:
    """``fixed:P:O``, ``uniform:PMIN-PMAX:OMIN-OMAX`` or ``zipf:PMIN-PMAX:OMIN-OMAX[:THETA]`` (default theta 1)."""
    parts = text.split(":")
    kind = parts[0]
    try:
        if kind == "fixed" and len(parts) == 3:
            p, o = int(parts[1]), int(parts[2])
            dist = LengthDistribution(kind, (p, p), (o, o))
        elif kind in ("uniform", "zipf") and len(parts) in ((3, 4) if kind == "zipf" else (3,)):
            dist = LengthDistribution(kind, _range(parts[1]), _range(parts[2]),
                                      float(parts[3]) if len(parts) == 4 else 1.0)
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"lengths={text!r}: expected fixed:P:O, uniform:PMIN-PMAX:OMIN-OMAX or "
                         f"zipf:PMIN-PMAX:OMIN-OMAX[:THETA]") from None
    for lo, hi in (dist.prompt, dist.output):
        if not 1 <= lo <= hi:
            raise ValueError(f"lengths={text!r}: a range must satisfy 1 <= lo <= hi")
    if dist.theta <= 0:
        raise ValueError(f"lengths={text!r}: theta must be > 0")
    return dist


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def sample_lengths(dist: LengthDistribution, n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """``n`` prompt lengths and ``n`` output lengths (tokens) from ``dist``."""

    def draw(lo: int, hi: int) -> np.ndarray:
        if dist.kind == "fixed":
            return np.full(n, lo)
        if dist.kind == "uniform":
            return rng.integers(lo, hi + 1, n)
        support = np.arange(lo, hi + 1)
        weights = support.astype(np.float64) ** -dist.theta
        return rng.choice(support, n, p=weights / weights.sum())

    return draw(*dist.prompt).tolist(), draw(*dist.output).tolist()


def _scale_clip(values: list[int], scale: float, cap: int | None, what: str) -> list[int]:
    _check_positive(f"{what}_scale", scale)
    if cap is not None:
        _check_positive(f"max_{what}", cap)
    out = [max(1, round(v * scale)) for v in values]
    return out if cap is None else [min(v, cap) for v in out]


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number")

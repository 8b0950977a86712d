"""Serving capacity (Sarathi-Serve's definition): the highest request rate at which P99 TBT stays within an SLO
and the median scheduling delay within a bound.

Torch-free: ``search_capacity`` takes any ``probe(qps) -> BenchResult`` (a real-time replay or a simulation)
and binary-searches the rate, assuming that passing is monotone (a rate passes if any higher one does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sarathi_lite.bench.results import BenchResult, Stopped

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class SLO:
    """tbt_p99: most P99 time between tokens (seconds). scheduling_delay_p50: most median scheduling delay
    (seconds; Sarathi-Serve uses 2 s)."""

    tbt_p99: float
    scheduling_delay_p50: float = 2.0

    def __post_init__(self) -> None:
        for name in ("tbt_p99", "scheduling_delay_p50"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: SLO bounds must be positive")

    def met_by(self, summary: dict[str, Any]) -> bool:
        """Whether a ``BenchResult.summary()`` meets both bounds. A run without token gaps (every output one
        token) meets the TBT bound; a run that finished no request meets nothing."""
        if not summary["num_requests"]:
            return False
        tbt, delay = summary["tbt_p99"], summary["scheduling_delay_p50"]
        return (tbt is None or tbt <= self.tbt_p99) and delay <= self.scheduling_delay_p50


@dataclass(slots=True)
class Probe:
    """One rate tried: ``qps`` (requests/s), whether it met the SLO, the two measured values (seconds) and the
    run itself (not serialized)."""

    qps: float
    passed: bool
    tbt_p99: float | None
    scheduling_delay_p50: float | None
    result: BenchResult | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"qps": self.qps, "passed": self.passed, "tbt_p99": self.tbt_p99,
                "scheduling_delay_p50": self.scheduling_delay_p50}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Probe:
        """The probe ``to_dict`` wrote (without its run)."""
        return cls(d["qps"], d["passed"], d["tbt_p99"], d["scheduling_delay_p50"])


@dataclass(slots=True)
class CapacityResult:
    """The probes of one configuration's search, in the order they ran; ``stopped``: empty for a whole search,
    else how far one stopped early got (its capacity then rests on the probes listed)."""

    label: str
    slo: SLO
    qps_range: tuple[float, float]
    probes: list[Probe] = field(default_factory=list)
    stopped: str = ""

    @property
    def capacity(self) -> float | None:
        """The highest rate that passed (requests/s); ``None`` if none did (capacity below the range)."""
        passed = [p.qps for p in self.probes if p.passed]
        return max(passed) if passed else None

    @property
    def failed_above(self) -> float | None:
        """The lowest rate that failed (requests/s); ``None`` if none did (capacity at least the range's top)."""
        failed = [p.qps for p in self.probes if not p.passed]
        return min(failed) if failed else None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "slo": {"tbt_p99": self.slo.tbt_p99,
                                             "scheduling_delay_p50": self.slo.scheduling_delay_p50},
                "qps_range": list(self.qps_range), "capacity": self.capacity, "failed_above": self.failed_above,
                "probes": [p.to_dict() for p in self.probes], **({"stopped": self.stopped} if self.stopped else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CapacityResult:
        """The search ``to_dict`` wrote (its probes without their runs)."""
        slo = SLO(d["slo"]["tbt_p99"], d["slo"]["scheduling_delay_p50"])
        return cls(d["label"], slo, tuple(d["qps_range"]), [Probe.from_dict(p) for p in d["probes"]],
                   d.get("stopped", ""))


def search_capacity(probe: Callable[[float], BenchResult], slo: SLO, qps_low: float, qps_high: float,
                    num_probes: int = 6, label: str = "", on_probe: Callable[[Probe], None] | None = None
                    ) -> CapacityResult:
    """Binary search on the rate in ``[qps_low, qps_high]`` (requests/s) with at most ``num_probes`` runs.

    ``qps_low`` runs first: if it fails, the search stops (capacity below the range). Then ``qps_high``: if it
    passes, the search stops (capacity at least the top). Then the midpoint of the highest pass and the lowest
    fail, until the probes are spent. The answer's error is at most ``(qps_high - qps_low) / 2 ** (num_probes -
    2)``.

    on_probe: called with each probe once it is recorded (a progress bar). Stopped early (``KeyboardInterrupt``),
    it raises ``Stopped`` with the search so far (the probes that finished).
    """
    if not 0 < qps_low < qps_high:
        raise ValueError(f"need 0 < qps_low < qps_high, got {qps_low}, {qps_high}")
    if num_probes < 2:
        raise ValueError(f"num_probes={num_probes} must be at least 2 (the two ends of the range)")
    out = CapacityResult(label, slo, (qps_low, qps_high))

    def run(qps: float) -> bool:
        result = probe(qps)
        s = result.summary()
        passed = slo.met_by(s)
        out.probes.append(Probe(qps, passed, s["tbt_p99"], s["scheduling_delay_p50"], result))
        if on_probe is not None:
            on_probe(out.probes[-1])
        logger.info("%s at %.3f req/s: P99 TBT %s s, median scheduling delay %s s -> %s", label, qps,
                    _fmt(s["tbt_p99"]), _fmt(s["scheduling_delay_p50"]), "pass" if passed else "fail")
        return passed

    try:
        if not run(qps_low) or run(qps_high):
            return out
        lo, hi = qps_low, qps_high
        for _ in range(num_probes - 2):
            mid = (lo + hi) / 2
            if run(mid):
                lo = mid
            else:
                hi = mid
    except KeyboardInterrupt:
        out.stopped = f"{len(out.probes)} of at most {num_probes} probes"
        raise Stopped(out, out.stopped) from None
    return out


def capacity_searches(searches: Sequence[Callable[[], CapacityResult]]) -> list[CapacityResult]:
    """Run each capacity search in turn; stopped early, raise ``Stopped`` with the finished searches and the one
    stopped (its probes so far)."""
    found: list[CapacityResult] = []
    for search in searches:
        try:
            found.append(search())
        except Stopped as stop:
            found.append(stop.partial)
            raise Stopped(found, f"{len(found) - 1} of {len(searches)} searches finished, the next stopped after "
                                 f"{stop.progress}") from None
        except KeyboardInterrupt:
            raise Stopped(found, f"{len(found)} of {len(searches)} searches finished") from None
    return found


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"

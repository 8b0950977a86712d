"""The messages between ``ProcessEngine``'s router and its instance processes (``engine/instance_child.py``): one
dataclass per command, and the replies. Every command carries ``drops``: handles of K/V the prefill side may
release (they ride on the next command to the instance, at no round trip of their own). Every reply carries the
instance's ``InstanceLoad`` after the command."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.metrics import IterationRecord
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import SchedulerConfig


@dataclass(slots=True)
class Command:
    """A command to an instance (a subclass names which)."""

    drops: list[int] = field(default_factory=list, kw_only=True)


@dataclass(slots=True)
class AddRequest(Command):
    """Queue a request: its first ``num_external_tokens`` prompt tokens' K/V comes from rank ``source`` under
    ``handle`` (a decode instance), or it is to be held under ``handle`` once prefilled (a prefill instance)."""

    request_id: str
    prompt: Any
    params: SamplingParams
    arrival: float
    num_external_tokens: int = 0
    handle: int | None = None
    source: int | None = None


@dataclass(slots=True)
class AbortRequest(Command):
    request_id: str


@dataclass(slots=True)
class Step(Command):
    """One step (two when the first only loaded K/V); the reply's result is a ``StepDone``."""


@dataclass(slots=True)
class PeerDown(Command):
    """The instance of KV rank ``rank`` is gone: no K/V is to be waited for from it."""

    rank: int


@dataclass(slots=True)
class GetPool(Command):
    """The KV pool's and the connector's counters (a ``dict``)."""


@dataclass(slots=True)
class GetStats(Command):
    """The engine's ``Stats``."""


@dataclass(slots=True)
class ResetStats(Command):
    pass


@dataclass(slots=True)
class ResetPrefixCache(Command):
    """The reply's result: blocks dropped from the prefix cache."""


@dataclass(slots=True)
class Close(Command):
    """Exit (after replying)."""


@dataclass(slots=True)
class StepDone:
    """What a step made: its ``outputs``, the K/V ``transfers`` it loaded (request id -> ``(seconds, blocks)``)
    and its iteration records."""

    outputs: list[RequestOutput]
    transfers: dict[str, tuple[float, int]]
    iterations: Sequence[IterationRecord]


@dataclass(slots=True, frozen=True)
class InstanceLoad:
    """What every reply carries: the router's measures (``routing.load_of``), whether the instance has work, and
    its snapshot."""

    pending_prefill_tokens: int
    kv_demand: int
    busy: bool
    snapshot: EngineSnapshot


@dataclass(slots=True, frozen=True)
class RemoteError:
    """A command that failed in the instance: ``ValueError`` (bad input) or ``RuntimeError``."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> RemoteError:
        if isinstance(e, ValueError):
            return cls("ValueError", f"{e}")
        return cls("RuntimeError", f"{type(e).__name__}: {e}")

    def exception(self) -> Exception:
        return (ValueError if self.kind == "ValueError" else RuntimeError)(self.message)


@dataclass(slots=True)
class Reply:
    """The answer to a command: its ``result`` or its ``error``, and the instance's ``load`` after it (``None``
    when the instance failed to start)."""

    result: Any = None
    error: RemoteError | None = None
    load: InstanceLoad | None = None


@dataclass(slots=True, frozen=True)
class Ready:
    """The first reply's result: the instance's scheduler and model configs."""

    scheduler_config: SchedulerConfig
    model_config: ModelConfig

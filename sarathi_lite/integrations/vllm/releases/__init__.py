"""One adapter module per supported vLLM release (``v0_32``, ``v0_33``, ``v0_34``), chosen by
``version.adapter(vllm.__version__)``. Each names ``RELEASE`` and ``CONFLICTS``: the release's own scheduler
settings that would override the plugin's step decision (a later release's module extends its predecessor's), which
the plugin refuses before the engine builds. No vLLM import here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Conflict:
    """A vLLM ``SchedulerConfig`` field the plugin needs at ``neutral`` (its default); ``why``: what it would do
    to the plugin's decision; ``flag``: the ``vllm serve`` flag that sets it."""

    field: str
    neutral: Any
    flag: str
    why: str


def refuse_conflicts(scheduler_config: Any, conflicts: Iterable[Conflict]) -> None:
    """Raise ``ValueError`` naming every field of ``conflicts`` that ``scheduler_config`` sets away from neutral."""
    bad = [c for c in conflicts if getattr(scheduler_config, c.field, c.neutral) != c.neutral]
    if bad:
        raise ValueError("sarathi_lite's scheduler decides each step itself; these vLLM settings would override it: "
                         + "; ".join(f"{c.flag} {getattr(scheduler_config, c.field)!r} ({c.why}; leave it at "
                                     f"{c.neutral!r})" for c in bad))

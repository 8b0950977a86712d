"""Checks a host's step log (one record per step: ``scheduled``, ``decodes``, and the requests whose KV blocks ran
out) supports, for every host of the decision: the vLLM plugin and the transformers host."""

from __future__ import annotations


def decodes_first_steps(steps: list[dict], excused: str) -> int:
    """Assert that no running decode was left out of a step that scheduled prefill tokens, except the requests the
    record's ``excused`` list names (those whose KV blocks ran out: vLLM's ``preempted``, transformers'
    ``starved``); return how many steps mixed decodes with prefill tokens."""
    mixed = 0
    for step in steps:
        scheduled = step["scheduled"]
        if any(rid not in step["decodes"] for rid in scheduled):
            left_out = [rid for rid in step["decodes"] if rid not in scheduled and rid not in step[excused]]
            assert not left_out, step
            mixed += bool(step["decodes"])
    return mixed

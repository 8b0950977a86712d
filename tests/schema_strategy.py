"""Hypothesis strategies for the JSON-schema subset FastAPI publishes in its OpenAPI document (objects with
properties and required fields, anyOf, $ref, const, enum, typed scalars with bounds, arrays with minItems).

A small converter of our own: hypothesis-jsonschema 0.23.1, the latest, fails on current hypothesis releases
(its object strategy calls a private API that is gone). A keyword outside the subset raises ``ValueError``, so a
schema that grows one fails the fuzz test loudly instead of going unfuzzed."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

IGNORED = {"title", "description", "default", "examples"}
HANDLED = {"$ref", "anyOf", "const", "enum", "type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
           "items", "minItems", "maxItems", "properties", "required", "additionalProperties", "minLength",
           "maxLength"}
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30]


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy:
    """Values valid under ``schema``; ``$ref``s resolve against ``root`` (the OpenAPI document)."""
    unknown = set(schema) - HANDLED - IGNORED
    if unknown:
        raise ValueError(f"schema keywords {sorted(unknown)} are not handled: extend tests/schema_strategy.py")
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return st.deferred(lambda: from_schema(target, root))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 24))
    if kind == "integer":
        lo = _bound(schema, "minimum", "exclusiveMinimum", 1)
        hi = _bound(schema, "maximum", "exclusiveMaximum", -1)
        edges = [v for v in EDGE_INTS + [lo, hi] if v is not None and (lo is None or v >= lo)
                 and (hi is None or v <= hi)]
        small_lo = lo if lo is not None else -2
        small = st.integers(small_lo, small_lo + 40 if hi is None else min(hi, small_lo + 40))
        return st.one_of(small, small, st.integers(lo, hi), st.sampled_from(edges))  # mostly values that run
    if kind == "number":
        return st.floats(min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                         max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), root), min_size=low,
                        max_size=schema.get("maxItems", low + 4))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not props:  # a map (logit_bias): keys mostly token ids, as clients send
            keys = st.one_of(st.integers(0, 400).map(str), st.integers(0, 400).map(str), st.text(max_size=4))
            return st.dictionaries(keys, from_schema(extra, root), max_size=4)
        return st.fixed_dictionaries({k: from_schema(v, root) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, root) for k, v in props.items()
                                               if k not in required})
    if not schema:
        return st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    raise ValueError(f"schema {schema} is not handled: extend tests/schema_strategy.py")


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, step: int) -> int | None:
    if inclusive in schema:
        return int(schema[inclusive])
    if exclusive in schema:
        return int(schema[exclusive]) + step
    return None

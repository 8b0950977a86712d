"""The policy registry: a policy is one ``decision.Policy`` subclass and one ``register_policy``; the policy lists
(``POLICIES``, ``CHUNKED_POLICIES``), ``SchedulerConfig``'s validation and ``make_policy`` all read it."""

from __future__ import annotations

from typing import Any

_REGISTRY: dict[str, Any] = {}  # policy name -> its Policy subclass, in registration order


def register_policy(cls: Any) -> Any:
    """Class decorator: register a ``Policy`` subclass under its ``name`` (its ``chunked`` attribute says whether
    it chunks prompts under ``chunk_size``). Raises ``ValueError`` if another class has the name."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "base":
        raise ValueError(f"{cls.__name__} needs a `name` to be registered")
    if not isinstance(getattr(cls, "chunked", None), bool):
        raise ValueError(f"{cls.__name__} needs `chunked = True` or `False` to be registered")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"policy {name!r} is already registered by {_REGISTRY[name].__name__}")
    _REGISTRY[name] = cls
    return cls


def policy_class(name: str) -> Any:
    """The registered class of policy ``name``. Raises ``ValueError`` naming the known policies otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy={name!r} is not one of {', '.join(_REGISTRY)}") from None


def policy_names() -> tuple[str, ...]:
    """Every registered policy, in registration order."""
    return tuple(_REGISTRY)


def chunked_policy_names() -> tuple[str, ...]:
    """The registered policies that chunk prompts under ``chunk_size``."""
    return tuple(name for name, cls in _REGISTRY.items() if cls.chunked)


def is_chunked(name: str) -> bool:
    cls = _REGISTRY.get(name)
    return cls is not None and cls.chunked

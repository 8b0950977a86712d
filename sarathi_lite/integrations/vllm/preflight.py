"""The plugin's checks, before vLLM builds an engine: the vLLM release (``version``), the release's settings that
would override the plugin (its adapter's ``CONFLICTS``), vLLM's scheduling policy, chunked prefill, and the
``sarathi_lite`` options. ``SarathiScheduler`` runs them when vLLM builds it; ``register`` (the
``vllm.general_plugins`` entry point in setup.py) runs them as soon as vLLM has made its configuration, so a
wrong version or option fails in ``vllm serve``'s first seconds instead of after the model loads."""

from __future__ import annotations

import functools
import logging
from typing import Any

from .options import PluginOptions, parse_options
from .releases import refuse_conflicts
from .version import adapter

logger = logging.getLogger(__name__)

PLUGIN_MODULE = "sarathi_lite.integrations.vllm"
"""The module ``--scheduler-cls`` names (``sarathi_lite.integrations.vllm.SarathiScheduler``)."""


def check_vllm_config(vllm_config: Any, version: str, num_blocks: int | None = None) -> PluginOptions:
    """Refuse what the plugin cannot run under (``RuntimeError`` for the vLLM version, ``ValueError`` naming the
    setting or option otherwise) and return the parsed options. ``num_blocks``: the KV pool's blocks, once vLLM
    has profiled it (before then the options are checked against a pool of ``max_num_seqs`` full-length
    requests)."""
    release = adapter(version)
    sched, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    if sched.policy != "fcfs":
        raise ValueError(f"sarathi_lite's scheduler orders requests itself: use vLLM's scheduling policy 'fcfs', "
                         f"not {sched.policy!r}")
    if not sched.enable_chunked_prefill:
        raise ValueError("sarathi_lite's scheduler chunks prompts: enable chunked prefill in vLLM")
    refuse_conflicts(sched, release.CONFLICTS)
    block_size = cache.block_size or 16
    max_model_len = model.max_model_len
    if num_blocks is None:
        num_blocks = sched.max_num_seqs * -(-max_model_len // block_size)
    return parse_options(
        vllm_config.additional_config, max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs, max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        enable_prefix_caching=bool(cache.enable_prefix_caching))


def names_plugin(scheduler_cls: Any) -> bool:
    """Whether vLLM's ``scheduler_cls`` (a qualified name or a class) is this plugin's."""
    name = scheduler_cls if isinstance(scheduler_cls, str) else getattr(scheduler_cls, "__module__", "") or ""
    return name == PLUGIN_MODULE or name.startswith(PLUGIN_MODULE + ".")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes before it makes a
    configuration. It wraps ``EngineArgs.create_engine_config`` so that a configuration naming this plugin's
    scheduler is checked (``check_vllm_config``) as soon as it is made; vLLM without the plugin is untouched
    (an unsupported vLLM release included: it is refused only where the plugin is asked for)."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if getattr(create, "_sarathi_lite_checked", False):  # vLLM calls its plugins once per process, maybe more
        return

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create(self, *args, **kwargs)
        if names_plugin(config.scheduler_config.scheduler_cls):
            import vllm

            check_vllm_config(config, vllm.__version__)
        return config

    create_engine_config._sarathi_lite_checked = True
    EngineArgs.create_engine_config = create_engine_config

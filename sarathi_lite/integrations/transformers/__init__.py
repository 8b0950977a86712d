"""sarathi-lite's scheduling inside Hugging Face transformers' continuous batching (``generate_batch``,
``init_continuous_batching``, ``transformers serve --continuous-batching`` through this package's ``serve``
launcher). Importing it registers ``"sarathi"`` in transformers' scheduler mapping::

    import sarathi_lite.integrations.transformers  # noqa: F401  registers "sarathi"
    from transformers import ContinuousBatchingConfig
    outputs = model.generate_batch(prompts, generation_config=gen,
                                   continuous_batching_config=ContinuousBatchingConfig(scheduler_type="sarathi"))

and ``register(name, **options)`` registers it with options named as in ``SchedulerConfig``
(``chunk_size=256``, or ``chunk_size="auto", tbt_slo=0.1, cost_model=...``; ``hol_protection``, ...). transformers
keeps its cache, requests and outputs. The only package of sarathi-lite that imports transformers' continuous
batching; importing it refuses an unsupported transformers version (``SUPPORTED_TRANSFORMERS_VERSIONS``)."""

import transformers

from .version import SUPPORTED_TRANSFORMERS_VERSIONS, check_transformers_version

check_transformers_version(transformers.__version__)

from .scheduler import SarathiScheduler, SchedulerName, register, request_view  # noqa: E402

register()  # "sarathi", with the default options

__all__ = ["SUPPORTED_TRANSFORMERS_VERSIONS", "SarathiScheduler", "SchedulerName", "check_transformers_version",
           "register", "request_view"]

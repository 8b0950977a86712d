"""The engine: ``EngineConfig``, the model runner and sampler, ``LLMEngine`` (the step API) and ``LLM``."""

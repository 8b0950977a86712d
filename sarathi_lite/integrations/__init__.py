"""sarathi-lite's scheduling inside other serving engines, each host in a package of its own that alone imports its
framework: ``sarathi_lite.integrations.vllm`` (a vLLM scheduler class, ``--scheduler-cls
sarathi_lite.integrations.vllm.SarathiScheduler``) and ``sarathi_lite.integrations.transformers`` (``"sarathi"`` in
transformers' continuous-batching scheduler mapping). ``options``: the options both take."""

"""sarathi-lite's scheduling inside other serving engines. ``sarathi_lite.integrations.vllm``: a vLLM scheduler
class (``--scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler``); it alone imports vLLM."""

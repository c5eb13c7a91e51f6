"""Size presets of the zoo: corpus slice, tokenizer, three model shapes, step counts.

Step counts are fixed (never wall-clock budgets) so builds are reproducible;
they were chosen from throughput measured with 2 threads on a 2-core AVX-512
BF16 machine:

* ``tiny``  (tests, demo): about 1.5 minutes. Target 0.9 M params / 2 layers.
* ``small`` (benchmarks): about 40 minutes, most of it the target
  (12.6 M params, 6 layers, GQA 6/2, ~6.5 M training tokens); the qualifier
  (2 layers) and the narrow 1-layer draft are distilled from it together.

Changing anything here changes the preset's hash, which makes an existing
build on disk stale: the next ``build_family`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from saguaro_ray.errors import ConfigError
from saguaro_ray.zoo.model import ModelShape
from saguaro_ray.zoo.train import TrainSpec

ROLES = ("target", "qualifier", "draft")


@dataclass(frozen=True)
class CorpusSpec:
    include_tests: bool = True
    max_bytes: int | None = None  # evenly spread subset of the training files


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    vocab_size: int
    corpus: CorpusSpec
    max_position_embeddings: int
    target: ModelShape
    qualifier: ModelShape
    draft: ModelShape
    target_train: TrainSpec
    distill: TrainSpec
    kl_weight: float  # distillation loss = kl_weight * KL + (1 - kl_weight) * CE
    eval_windows: int  # held-out windows of distill.seq_len + 1 tokens
    threads: int = 2  # torch threads for the build (fixed: reproducible weights)

    def shape(self, role: str) -> ModelShape:
        return {"target": self.target, "qualifier": self.qualifier, "draft": self.draft}[role]

    def hash(self) -> str:
        """Hash of everything that shapes the weights (not the description)."""
        fields = asdict(self)
        fields.pop("description")
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="test/demo family: builds in about 1.5 minutes on 2 cores",
        vocab_size=2048,
        corpus=CorpusSpec(include_tests=False, max_bytes=3_000_000),
        max_position_embeddings=2048,
        target=ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
        qualifier=ModelShape(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=384),
        draft=ModelShape(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=192),
        target_train=TrainSpec(steps=300, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=30, seed=0),
        distill=TrainSpec(steps=200, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=30, seed=1),
        kl_weight=0.8,
        eval_windows=32,
    ),
    "small": Preset(
        name="small",
        description="benchmark family: builds in about 40 minutes on 2 cores",
        vocab_size=4096,
        corpus=CorpusSpec(include_tests=True, max_bytes=None),
        max_position_embeddings=2048,
        target=ModelShape(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024),
        qualifier=ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=768),
        draft=ModelShape(hidden_size=192, num_layers=1, num_heads=3, num_kv_heads=3, intermediate_size=768),
        target_train=TrainSpec(steps=1600, batch_size=8, seq_len=512, lr=1.5e-3, warmup_steps=100, seed=0),
        distill=TrainSpec(steps=1000, batch_size=8, seq_len=512, lr=2e-3, warmup_steps=50, seed=1),
        kl_weight=0.9,
        eval_windows=64,
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(PRESETS))
        raise ConfigError(f"unknown zoo preset {name!r}; valid presets: {valid}") from None

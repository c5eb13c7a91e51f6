"""Size presets of the zoo: corpus slice, tokenizer, three model shapes, step counts.

The numbers are in ``presets.yaml`` next to this module, with the
measurements that chose them; this module gives them their types.

* ``tiny``  (tests, demo): about 1.5 minutes.
* ``small`` (benchmarks): about 40 minutes.

Changing anything in a preset changes its hash, which makes an existing
build on disk stale: the next ``build_family`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

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


def _load_presets() -> dict[str, Preset]:
    """The presets as ``presets.yaml`` writes them (a table of numbers, so it is data)."""
    table = yaml.safe_load((Path(__file__).parent / "presets.yaml").read_text())
    presets = {}
    for name, fields in table.items():
        fields = dict(fields)
        presets[name] = Preset(
            name=name,
            corpus=CorpusSpec(**fields.pop("corpus")),
            **{role: ModelShape(**fields.pop(role)) for role in ROLES},
            target_train=TrainSpec(**fields.pop("target_train")),
            distill=TrainSpec(**fields.pop("distill")),
            **fields,
        )
    return presets


PRESETS: dict[str, Preset] = _load_presets()


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(PRESETS))
        raise ConfigError(f"unknown zoo preset {name!r}; valid presets: {valid}") from None

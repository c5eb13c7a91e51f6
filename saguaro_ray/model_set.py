"""The models an engine runs, and the facts every engine derives from them — in one place.

Which models an engine's strategies need is decided here and nowhere else:
the target always, a draft for ``sd``/``ssd``/``pyramid`` (and for ``auto``
when one is given: without it ``auto`` is AR), a qualifier for ``pyramid``;
and which strategies an engine allows follows from the same rule
(:func:`allowed_modes`). A :class:`ModelSet` resolves those specs through
:mod:`saguaro_ray.models.resolve` (which may build or convert a named model
on first use — in the driver, before any worker starts), opens and validates
every checkpoint and the target's tokenizer, refuses a draft or qualifier
whose vocabulary differs from the target's, and derives what the request
side needs: the end-of-sequence ids, the context window (the smallest of the
models'), the vocabulary size. The in-process engine, the Ray launcher, the
coordinator, the CLI, the jobs and the Serve replica all open their models
through it, so they agree on every one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from saguaro_ray.errors import ConfigError, IncompatibleModelsError
from saguaro_ray.models.resolve import resolve_models
from saguaro_ray.models.spec import ModelRef, Spec
from saguaro_ray.tokenizer import check_same_vocabulary, end_of_sequence_ids, load_tokenizer
from saguaro_ray.workers.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from saguaro_ray.config import SpeculationConfig

ModelSpec = Spec | ModelRef


def allowed_modes(spec: "SpeculationConfig", has_draft: bool, has_qualifier: bool) -> tuple[str, ...]:
    """The strategies requests to an engine of ``spec`` may name: ``allow``
    as configured, else the default ``mode`` alone — or, for ``auto``,
    ``auto`` and every fixed mode the given models can run."""
    if spec.allow:
        return spec.allow
    if spec.mode != "auto":
        return (spec.mode,)
    return ("auto", "ar") + (("sd", "ssd") if has_draft else ()) + (("pyramid",) if has_draft and has_qualifier else ())


def model_roles(spec: "SpeculationConfig", has_draft: bool = False, has_qualifier: bool = False) -> tuple[str, ...]:
    """The model roles an engine of ``spec`` runs, target first
    (``has_*``: whether that model was given — ``auto`` uses a draft when
    there is one)."""
    allowed = allowed_modes(spec, has_draft, has_qualifier)
    draft = bool({"sd", "ssd", "pyramid"} & set(allowed)) or ("auto" in allowed and has_draft)
    return ("target",) + (("draft",) if draft else ()) + (("qualifier",) if "pyramid" in allowed else ())


def worker_roles(spec: "SpeculationConfig", num_drafts: int, has_draft: bool = False, has_qualifier: bool = False) -> list[str]:
    """The distributed engine's worker roles in launch order: ``target``,
    ``draft0``..``draft{num_drafts-1}`` (SSD splits the outcome set between
    them), ``qualifier``."""
    return [w for role in model_roles(spec, has_draft, has_qualifier) for w in ([f"draft{i}" for i in range(num_drafts)] if role == "draft" else [role])]


def role_kind(role: str) -> str:
    """The model role of a worker role: ``draft0`` → ``draft``."""
    return "draft" if role.startswith("draft") else role


def needed_specs(
    modes: Iterable["SpeculationConfig"], target: ModelSpec | None, draft: ModelSpec | None = None, qualifier: ModelSpec | None = None
) -> dict[str, ModelSpec]:
    """Role → spec of every model one of ``modes`` runs (given ones no mode
    runs are left out); a model a mode needs but was not given is a
    :class:`ConfigError` naming the mode."""
    given = {"target": target, "draft": draft, "qualifier": qualifier}
    if not target:
        raise ConfigError("target model is required")
    out: dict[str, ModelSpec] = {}
    for spec in modes:
        for role in model_roles(spec, bool(draft), bool(qualifier)):
            if not given[role]:
                needs = [m for m in allowed_modes(spec, bool(draft), bool(qualifier)) if m in (("pyramid",) if role == "qualifier" else ("sd", "ssd", "pyramid"))]
                raise ConfigError(f"mode {needs[0]!r} needs a {role} model")
            out[role] = given[role]  # type: ignore[assignment]
    return {role: out[role] for role in given if role in out}


@dataclass(frozen=True)
class ModelSet:
    """Resolved, opened and cross-checked models, by role (``target``, and
    ``draft``/``qualifier`` where a mode runs them). It never travels to a
    Ray actor (it holds a tokenizer and opened checkpoints): an actor gets
    :attr:`refs` and opens its own — resolving a :class:`ModelRef` again does no work."""

    refs: Mapping[str, ModelRef]
    checkpoints: Mapping[str, Checkpoint]
    tokenizer: Any

    @classmethod
    def open(
        cls,
        target: ModelSpec | None,
        draft: ModelSpec | None = None,
        qualifier: ModelSpec | None = None,
        *,
        modes: Iterable["SpeculationConfig"],
    ) -> "ModelSet":
        """The models ``modes`` run (one engine: one mode; a Serve replica:
        the modes of all its engines, each then :meth:`restrict`-ed)."""
        return cls.from_specs(needed_specs(modes, target, draft, qualifier))

    @classmethod
    def from_specs(cls, specs: Mapping[str, ModelSpec]) -> "ModelSet":
        """Resolve and open ``specs`` (role → spec, a ``target`` among them)
        as they are, without asking which mode runs them."""
        refs = resolve_models(specs)
        target = open_checkpoint(refs["target"].path)
        # a self-draft (the target's own directory) shares the target's checkpoint and, trivially, its tokenizer
        ckpts = {role: target if ref.path == refs["target"].path else open_checkpoint(ref.path) for role, ref in refs.items()}
        tokenizer = load_tokenizer(target.path)
        for role, ck in ckpts.items():
            if ck is target:
                continue
            if ck.config.vocab_size != target.config.vocab_size:
                raise IncompatibleModelsError(
                    f"{role} {ck.path} has vocab_size {ck.config.vocab_size}, the target {target.path} has "
                    f"{target.config.vocab_size}; speculation needs one shared vocabulary"
                )
            check_same_vocabulary(tokenizer, load_tokenizer(ck.path), role)
        return cls(refs, ckpts, tokenizer)

    def restrict(self, spec: "SpeculationConfig") -> "ModelSet":
        """The models of ``spec``'s mode alone (its context window is theirs)."""
        roles = needed_specs([spec], *(self.refs.get(r) for r in ("target", "draft", "qualifier")))
        return ModelSet({r: self.refs[r] for r in roles}, {r: self.checkpoints[r] for r in roles}, self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.checkpoints["target"].config.vocab_size

    @property
    def max_context(self) -> int:
        """Tokens a sequence may reach: every model must hold all of them."""
        return min(ck.config.max_position_embeddings for ck in self.checkpoints.values())

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The target's end-of-sequence ids (its config's, else its tokenizer's)."""
        return end_of_sequence_ids(self.checkpoints["target"].config.eos_token_ids, self.tokenizer)


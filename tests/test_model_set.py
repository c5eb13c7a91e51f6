"""ModelSet: which models a mode runs, and the facts every engine derives from them;
the one engine config both engines take; the one stream chunk every engine yields."""

from __future__ import annotations

import pytest
from helpers import save_tiny_checkpoint, torch_threads

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.engine.frontend import StreamChunk
from saguaro_ray.errors import ConfigError
from saguaro_ray.model_set import ModelSet, model_roles, needed_specs, worker_roles
from saguaro_ray.runtime.engine_config import EngineConfig

AR, SD, SSD, PYRAMID = (SpeculationConfig(mode=m) for m in ("ar", "sd", "ssd", "pyramid"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("model-set")
    return {
        "target": str(save_tiny_checkpoint(root / "t", "llama", seed=0, max_position_embeddings=96)),
        "short": str(save_tiny_checkpoint(root / "s", "qwen3", seed=1, max_position_embeddings=40)),
    }


def test_the_roles_each_mode_runs():
    assert [model_roles(s) for s in (AR, SD, SSD, PYRAMID)] == [
        ("target",),
        ("target", "draft"),
        ("target", "draft"),
        ("target", "draft", "qualifier"),
    ]
    assert worker_roles(SSD, 3) == ["target", "draft0", "draft1", "draft2"]
    assert worker_roles(PYRAMID, 1) == ["target", "draft0", "qualifier"]
    assert EngineConfig(target="t", draft="d", spec=SSD, num_drafts=2).roles == ["target", "draft0", "draft1"]


def test_needed_specs_keep_what_a_mode_runs_and_refuse_what_it_lacks():
    assert needed_specs([AR], "t", "d", "q") == {"target": "t"}
    assert needed_specs([AR, PYRAMID], "t", "d", "q") == {"target": "t", "draft": "d", "qualifier": "q"}
    with pytest.raises(ConfigError, match="mode 'sd' needs a draft model"):
        needed_specs([AR, SD], "t")
    with pytest.raises(ConfigError, match="mode 'pyramid' needs a qualifier model"):
        EngineConfig(target="t", draft="d", spec=PYRAMID)
    with pytest.raises(ConfigError, match="target model is required"):
        EngineConfig(target="")


def test_a_model_set_opens_once_and_restricts_to_a_mode(ckpts):
    models = ModelSet.open(ckpts["target"], ckpts["short"], modes=[AR, SD])
    assert set(models.refs) == {"target", "draft"}
    assert models.max_context == 40  # every model must hold the sequence
    assert models.restrict(AR).max_context == 96  # AR runs the target alone
    assert models.restrict(AR).checkpoints["target"] is models.checkpoints["target"]  # nothing opened twice
    assert models.vocab_size == models.checkpoints["target"].config.vocab_size
    assert models.eos_ids == (2,)  # the tiny tokenizer's </s>, from the target's config
    with pytest.raises(ConfigError, match="mode 'pyramid' needs a qualifier model"):
        models.restrict(PYRAMID)


def test_the_in_process_engine_takes_the_one_config_and_streams_chunks(ckpts):
    with pytest.raises(ConfigError, match="target_tp=2 needs the Ray runtime"):
        LocalEngine(EngineConfig(target=ckpts["target"], target_tp=2))
    with torch_threads(1):
        engine = LocalEngine(EngineConfig(target=ckpts["target"], draft=ckpts["short"], spec=SD, threads_per_worker=1))
        try:
            assert engine.max_context == 40
            chunks = list(engine.stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
            [whole] = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        finally:
            engine.close()
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats is not None


def test_threads_and_build_ahead_are_validated():
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="threads_per_worker"):
            EngineConfig(target="t", threads_per_worker=bad)
    with pytest.raises(ConfigError, match="build_ahead"):
        EngineConfig(target="t", build_ahead="yes")
    assert EngineConfig(target="t").worker_threads == 1


def test_bundles_follow_the_config():
    cfg = EngineConfig(target="t", device="cuda", gpus_per_worker=0.5, resources={"draft": {"node_a": 1}, "coordinator": {"head": 1}})
    assert cfg.bundle("coordinator") == {"CPU": 0.25, "head": 1}
    assert cfg.bundle("draft1") == {"CPU": 0.5, "GPU": 0.5, "node_a": 1}
    assert cfg.bundle("target") == {"CPU": 0.5, "GPU": 0.5}


# ------------------------------------------------- a separate draft quantised at load
def test_a_quantised_spec_names_any_model_quantised_at_load(tmp_path):
    """``int4:<spec>`` / ``int8:<spec>``: a draft or qualifier given as any spec,
    quantised when loaded; the target runs as stored, and a scheme wraps no
    ``self:`` or other scheme."""
    from saguaro_ray.models.resolve import resolve_models
    from saguaro_ray.models.spec import ModelRef

    target = str(save_tiny_checkpoint(tmp_path, "llama", seed=0))
    draft = str(save_tiny_checkpoint(tmp_path / "d", "llama", seed=1))
    refs = resolve_models({"target": target, "draft": f"int4:{draft}", "qualifier": f"int8:{target}"})
    assert refs["draft"] == ModelRef(draft, "int4") and refs["qualifier"] == ModelRef(target, "int8")
    for bad, where in (({"target": f"int4:{target}"}, "run as stored"), ({"target": target, "draft": "int4:self:int8"}, "self:int4"),
                       ({"target": target, "draft": "int8:int4:x"}, "quantises a model"), ({"target": target, "draft": "int4:"}, "quantises a model")):
        with pytest.raises(ConfigError, match=where):
            resolve_models(bad)

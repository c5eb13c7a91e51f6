"""The built-in model family (saguaro_ray.zoo): on-disk format, summary, cache, specs."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from saguaro_ray.errors import ConfigError
from saguaro_ray.zoo import (
    PRESETS,
    ROLES,
    build_family,
    format_summary,
    heldout_texts,
    zoo_root,
)
from saguaro_ray.models import resolve_model_path
from saguaro_ray.zoo import build as zoo_build
from saguaro_ray.zoo.corpus import corpus_files


def test_family_dirs_load_with_transformers(zoo_tiny: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab = set()
    for role in ROLES:
        d = zoo_tiny / role
        for name in (
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            assert (d / name).is_file(), f"{role}/{name} missing"
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        assert model.config.vocab_size == len(tok)
        assert tok.eos_token == "<|endoftext|>"
        assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
        vocab.add(model.config.vocab_size)
        with torch.no_grad():
            logits = model(torch.tensor([tok("import os\n")["input_ids"]])).logits
        assert torch.isfinite(logits).all()
    assert len(vocab) == 1, f"vocab sizes differ: {vocab}"
    # One shared tokenizer, byte for byte.
    tok_files = {(zoo_tiny / r / "tokenizer.json").read_bytes() for r in ROLES}
    assert len(tok_files) == 1


def test_target_uses_gqa_and_models_shrink(zoo_tiny: Path):
    cfgs = {r: json.loads((zoo_tiny / r / "config.json").read_text()) for r in ROLES}
    t = cfgs["target"]
    assert t["num_key_value_heads"] < t["num_attention_heads"]
    assert cfgs["draft"]["num_hidden_layers"] == 1
    assert cfgs["draft"]["hidden_size"] < t["hidden_size"]


def test_chat_template_and_special_tokens(zoo_tiny: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo_tiny / "target")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "print hello"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>\nprint hello\n<|assistant|>\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids
    # Byte-level BPE round-trips arbitrary text.
    sample = "def f(x):\n    return x ** 2  # ünïcödé\n"
    assert tok.decode(tok(sample)["input_ids"]) == sample


def test_summary_fields_are_sane(zoo_tiny: Path):
    summary = json.loads((zoo_tiny / "zoo.json").read_text())
    assert summary["preset"] == "tiny"
    assert summary["version"] == zoo_build.BUILD_VERSION
    assert isinstance(summary["fingerprint"], str) and summary["fingerprint"]
    c = summary["corpus"]
    assert Path(c["source"]).is_dir()
    for key in ("train_files", "heldout_files", "train_tokens", "heldout_tokens"):
        assert c[key] > 0, key
    models = summary["models"]
    assert set(models) == set(ROLES)
    for role, m in models.items():
        assert m["params"] > 0 and m["layers"] >= 1 and m["hidden_size"] > 0
        assert math.isfinite(m["heldout_loss"]) and 0 < m["heldout_loss"] < math.log(summary["tokenizer"]["vocab_size"])
        assert m["build_seconds"] >= 0
        if role != "target":
            assert 0.0 <= m["greedy_agreement"] <= 1.0
    assert "greedy_agreement" not in models["target"]
    assert models["draft"]["params"] < models["target"]["params"]
    assert models["qualifier"]["params"] < models["target"]["params"]
    # Distillation makes the draft agree with the target far above chance.
    assert models["draft"]["greedy_agreement"] > 0.3
    assert summary["build_seconds"] > 0
    table = format_summary(summary)
    for role in ROLES:
        assert role in table


def test_second_build_returns_cached(zoo_tiny: Path):
    weights = zoo_tiny / "target" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    summary = build_family("tiny")
    assert weights.stat().st_mtime_ns == before
    assert summary == json.loads((zoo_tiny / "zoo.json").read_text())


def test_resolve_model_path(zoo_tiny: Path):
    p = resolve_model_path("zoo:tiny/draft")
    assert p == zoo_root() / "tiny" / "draft"
    assert p.resolve() == (zoo_tiny / "draft").resolve()
    assert (p / "config.json").is_file()
    # Anything else passes through unchanged, existing or not.
    assert resolve_model_path("/no/such/model") == Path("/no/such/model")
    assert resolve_model_path(Path("relative/dir")) == Path("relative/dir")
    assert resolve_model_path("zoo-like-name") == Path("zoo-like-name")


@pytest.mark.parametrize(
    "spec",
    ["zoo:", "zoo:tiny", "zoo:tiny/", "zoo:/draft", "zoo:tiny/drafter", "zoo:tiny/draft/x", "zoo:huge/target"],
)
def test_malformed_zoo_spec_raises(spec: str):
    with pytest.raises(ConfigError, match=r"zoo:<preset>/<role>"):
        resolve_model_path(spec)


def test_unknown_preset_lists_valid_ones(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        build_family("huge", out=tmp_path / "x")
    for name in PRESETS:
        assert name in str(err.value)
    assert not (tmp_path / "x").exists()


def test_heldout_is_disjoint_from_training():
    held = heldout_texts()
    assert held and held == heldout_texts()  # deterministic
    assert heldout_texts(max_files=3) == held[:3]
    train = {f.text for f in corpus_files(heldout=False)}
    assert not train & set(held)
    train_paths = {f.relpath for f in corpus_files(heldout=False)}
    held_paths = {f.relpath for f in corpus_files(heldout=True)}
    assert not train_paths & held_paths
    # Every preset trains on a subset of the training files only.
    for p in PRESETS.values():
        used = corpus_files(heldout=False, include_tests=p.corpus.include_tests, max_bytes=p.corpus.max_bytes)
        assert used and {f.relpath for f in used} <= train_paths


# --- build directory handling, with the expensive part replaced by a fake ----------------


def _fake_builder(calls: list, delay: float = 0.0, fail: bool = False):
    def fake_build_into(tmp: Path, preset, say, progress):
        calls.append(tmp)
        for role in ROLES:
            (tmp / role).mkdir()
            for name in zoo_build._REQUIRED_FILES:
                (tmp / role / name).write_text("{}")
        time.sleep(delay)
        if fail:
            raise KeyboardInterrupt  # an interrupted build
        summary = {
            "preset": preset.name,
            "version": zoo_build.BUILD_VERSION,
            "preset_hash": preset.hash(),
            "build_seconds": delay,
        }
        (tmp / zoo_build.SUMMARY_FILE).write_text(json.dumps(summary))
        return summary

    return fake_build_into


def test_interrupted_build_never_looks_complete(tmp_path: Path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(zoo_build, "build_into", _fake_builder(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        build_family("tiny", out=tmp_path / "fam", progress=False)
    assert not (tmp_path / "fam").exists()
    assert not list(tmp_path.glob(".fam.building-*"))
    # The next call builds for real (here: the fake) and completes.
    monkeypatch.setattr(zoo_build, "build_into", _fake_builder(calls))
    summary = build_family("tiny", out=tmp_path / "fam", progress=False)
    assert summary["preset"] == "tiny" and (tmp_path / "fam" / "zoo.json").is_file()


def test_concurrent_builds_build_once(tmp_path: Path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(zoo_build, "build_into", _fake_builder(calls, delay=0.5))
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(build_family("tiny", out=tmp_path / "fam", progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 3 and all(r == results[0] for r in results)


def test_stale_build_is_replaced_and_foreign_dir_refused(tmp_path: Path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(zoo_build, "build_into", _fake_builder(calls))
    fam = tmp_path / "fam"
    build_family("tiny", out=fam, progress=False)
    summary = json.loads((fam / "zoo.json").read_text())
    summary["version"] = -1  # built by an older procedure
    (fam / "zoo.json").write_text(json.dumps(summary))
    build_family("tiny", out=fam, progress=False)
    assert len(calls) == 2
    assert json.loads((fam / "zoo.json").read_text())["version"] == zoo_build.BUILD_VERSION

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a zoo family"):
        build_family("tiny", out=foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"

"""Loader errors: every broken checkpoint raises a specific saguaro-ray error
whose message names what is wrong, before (or instead of) running anything."""

from __future__ import annotations

import json
import subprocess
import sys
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import save_tiny_checkpoint
from saguaro_ray.errors import CheckpointError, SaguaroError, UnsupportedArchitectureError
from saguaro_ray.workers.checkpoint import load_decoder, open_checkpoint
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """One good tiny Llama checkpoint (with tokenizer); tests copy it."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("pristine"), "llama")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the good checkpoint."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def edit_config(path: Path, **changes) -> None:
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_file.write_text(json.dumps(cfg))


def test_pristine_checkpoint_opens(ckpt: Path) -> None:
    c = open_checkpoint(ckpt)
    assert c.config.model_type == "llama"
    assert c.weight_files == [ckpt / "model.safetensors"]
    ModelRunner(ckpt)  # and loads


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match="does not exist") as exc:
        open_checkpoint(missing)
    assert str(missing) in str(exc.value)
    # the runner surfaces the same error for a string path
    with pytest.raises(CheckpointError, match="no-such-model"):
        ModelRunner(str(missing))


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(f)


def test_directory_without_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        open_checkpoint(ckpt)


def test_unreadable_config(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json.*unreadable"):
        open_checkpoint(ckpt)


def test_unsupported_model_type(ckpt: Path) -> None:
    edit_config(ckpt, model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2") as exc:
        open_checkpoint(ckpt)
    msg = str(exc.value)
    assert "model_type" in msg and "llama" in msg  # says what is supported
    assert isinstance(exc.value, CheckpointError) and isinstance(exc.value, SaguaroError)


def test_missing_model_type(ckpt: Path) -> None:
    edit_config(ckpt, model_type=None)
    with pytest.raises(UnsupportedArchitectureError, match="model_type"):
        open_checkpoint(ckpt)


@pytest.mark.parametrize(
    "changes",
    [
        # transformers 5.x layout
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}},
        # classic layout (transformers 4.x / older checkpoints)
        {"rope_parameters": None, "rope_theta": 10000.0,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
        # very old key name
        {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    ],
    ids=["rope_parameters", "rope_scaling", "legacy-type-key"],
)
def test_unsupported_rope_type(ckpt: Path, changes: dict) -> None:
    edit_config(ckpt, **changes)
    with pytest.raises(UnsupportedArchitectureError, match="yarn") as exc:
        open_checkpoint(ckpt)
    assert "rope" in str(exc.value)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_other_unsupported_rope_types(ckpt: Path, rope_type: str) -> None:
    edit_config(ckpt, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedArchitectureError, match=rope_type):
        open_checkpoint(ckpt)


def test_unsupported_activation(ckpt: Path) -> None:
    edit_config(ckpt, hidden_act="gelu")
    with pytest.raises(UnsupportedArchitectureError, match="gelu"):
        open_checkpoint(ckpt)


def test_qwen_sliding_window_refused(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path, "qwen2")
    edit_config(path, use_sliding_window=True, sliding_window=8)
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        open_checkpoint(path)


def test_no_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights") as exc:
        open_checkpoint(ckpt)
    assert "model.safetensors" in str(exc.value)


def test_only_pytorch_bin(ckpt: Path) -> None:
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors") as exc:
        open_checkpoint(ckpt)
    assert ".bin" in str(exc.value)


def test_shard_index_names_missing_file(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path, "llama", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    victim = shards[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match="missing") as exc:
        open_checkpoint(path)
    assert victim in str(exc.value)
    assert shards[0] not in str(exc.value)  # names only the missing one


def test_unreadable_shard_index(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path, "llama", max_shard_size="20KB")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))  # no weight_map
    with pytest.raises(CheckpointError, match="shard index"):
        open_checkpoint(path)


def test_tensor_with_wrong_shape(ckpt: Path) -> None:
    state = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    good_shape = tuple(state[name].shape)
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    c = open_checkpoint(ckpt)  # the header is fine; shapes are checked when loading
    with pytest.raises(CheckpointError, match=name) as exc:
        load_decoder(c, torch.device("cpu"), torch.float32)
    msg = str(exc.value)
    assert str(tuple(state[name].shape)) in msg and str(good_shape) in msg
    with pytest.raises(CheckpointError, match="shape"):
        ModelRunner(ckpt)


def test_config_disagrees_with_weights(ckpt: Path) -> None:
    edit_config(ckpt, intermediate_size=48)
    with pytest.raises(CheckpointError, match="shape"):
        ModelRunner(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.0.self_attn.k_proj.weight"]
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        ModelRunner(ckpt)


def test_missing_tokenizer(ckpt: Path) -> None:
    for f in ckpt.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="tokenizer") as exc:
        open_checkpoint(ckpt)  # require_tokenizer=True is the default
    assert "tokenizer.json" in str(exc.value)
    with pytest.raises(CheckpointError, match="tokenizer"):
        ModelRunner(ckpt)
    # explicitly not needed: opens and loads
    c = open_checkpoint(ckpt, require_tokenizer=False)
    ModelRunner(c)


def test_helper_without_tokenizer(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path, "qwen3", tokenizer=False)
    with pytest.raises(CheckpointError, match="tokenizer"):
        open_checkpoint(path)
    assert open_checkpoint(path, require_tokenizer=False).config.model_type == "qwen3"


def test_loading_a_checkpoint_never_reaches_the_zoo():
    """Opening or loading a checkpoint only reads a directory: importing the
    loader must not import the zoo (whose build trains models) nor the spec
    resolver that builds it — a worker process never resolves a name."""
    code = (
        "import sys, saguaro_ray.workers.checkpoint\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('saguaro_ray.zoo', 'saguaro_ray.models.resolve')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""

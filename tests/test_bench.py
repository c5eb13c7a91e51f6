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
         "--modes", "ar,sd:2,ssd,auto", "--prompts", "code", "--max-tokens", "8,5", "--batch-sizes", "1,2", "--temperatures", "0",
         "--mixed", "--repeats", "1", "--runtimes", "inprocess", "--build-ahead", "on", "--json", str(out_json), "--plot", str(out_png),
         "--markdown", str(tmp_path / "bench.md"), "--rounds", str(tmp_path / "rounds.jsonl")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    table = (tmp_path / "bench.md").read_text().splitlines()  # the README's table: a header, a rule, a row per cell
    assert table[0] == "| tokens, batch, T | ar | sd:2 | ssd | auto | auto / best fixed | auto / AR | auto chose |"
    assert [line.split(" | ")[0] for line in table[2:]] == [f"| {n}, {b}, {t}" for n in (8, 5) for b in (1, 2) for t in ("0", "mixed 0/0.7")]
    assert {"machine", "results", "step_costs_ms"} <= set(report)
    assert report["config"]["build_ahead"] is True  # in process too, as asked
    assert report["machine"]["cpu_count"] >= 1
    results = report["results"]
    assert len(results) == 4 * 2 * 2 * 2  # modes x lengths x batch sizes x (T = 0, the 0/0.7 mix)
    assert {e["temperature"] for e in results} == {0.0, "mix:0,0.7"} and {e["max_tokens"] for e in results} == {8, 5}
    for e in results:
        assert RESULT_KEYS <= set(e)
        assert e["tokens_per_s"] > 0 and e["ideal_tokens_per_s"] > 0 and e["ideal_speedup_vs_ar"] > 0
        if e["mode"] == "ar":
            assert e["speedup_vs_ar"] == 1.0 and e["mean_accepted"] is None and set(e["strategy"]) == {"ar"}
            assert e["same_as_ar"] is None
        else:  # the bench's own exactness check: every request of every mode is AR's, the seeded T = 0.7 ones too
            assert e["same_as_ar"]["of"] > 0 and e["same_as_ar"]["equal"] == e["same_as_ar"]["of"]
        if e["mode"] == "sd:2":  # the K sweep's strategy reached its requests
            assert set(e["strategy"]) == {"sd"} and 0 < e["mean_k"] <= 2 and 0 <= e["mean_accepted"] <= 2
        assert e["hops_ms"]["send"] is not None and e["hops_ms"]["reply"] is not None
        if e["mode"] == "ssd":
            assert 0 <= e["cache_hit_rate"] <= 1 and e["efficiency"] > 0
            split = e["hit_by_outcome"]  # every lookup is at full acceptance or at a rejection, and the hits add up
            assert split["full"]["share"] + split["rejected"]["share"] == pytest.approx(1.0)
            assert sum(x["share"] * x["hit_rate"] for x in split.values()) == pytest.approx(e["cache_hit_rate"])
            assert 0 <= e["build_ahead_fraction"] <= 1 and 0 <= e["drafting_hidden_fraction"] <= 1
            assert None not in (e["hops_ms"]["bookkeeping"], e["hops_ms"]["lookup_send"], e["hops_ms"]["lookup_reply"])
        elif e["mode"] != "auto":
            assert e["cache_hit_rate"] is None and e["efficiency"] is None
        cell = [x for x in results if (x["max_tokens"], x["batch_size"], x["temperature"]) == (e["max_tokens"], e["batch_size"], e["temperature"])]
        best = max((x for x in cell if x["mode"] != "auto"), key=lambda x: x["tokens_per_s"])
        assert e["best_fixed"] == best["mode"]
        if e["mode"] == "auto":  # every cell's auto row, beside its best fixed mode
            assert e["auto_vs_best"] == pytest.approx(e["tokens_per_s"] / best["tokens_per_s"])
            assert e["auto_vs_ar"] == pytest.approx(e["speedup_vs_ar"])
            assert sum(e["strategy"].values()) > 0 and set(e["strategy"]) <= {"ar", "sd", "ssd"}
    assert len([e for e in results if e["mode"] == "auto"]) == 2 * 2 * 2
    chose = report["engine_strategies"]["inprocess/d1"]  # the one engine's own count of what every run chose
    assert chose["sequence_rounds"]["ar"] >= sum(e["strategy"]["ar"] for e in results if e["mode"] == "ar")
    assert chose["policy"]["rounds_chosen"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in proc.stdout and "=ar" in proc.stdout
    # --rounds: every batch each mode generated, with the rounds and strategies the report summarised
    from saguaro_ray.bench.report import _added

    lines = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    prompts = report["config"]["num_prompts"]
    for e in results:
        labels = ("mode", "max_tokens", "batch_size", "temperature")
        mine = [x for x in lines if all(x[k] == e[k] for k in labels)]
        assert [x["first"] for x in mine] == list(range(0, prompts, e["batch_size"])) and {x["repeat"] for x in mine} == {0}
        assert all(len(x["outputs"]) == min(e["batch_size"], prompts - x["first"]) for x in mine)
        assert all(len(o) == e["max_tokens"] for x in mine for o in x["outputs"])  # each length's requests, that long
        decode = [rd for x in mine for rd in x["rounds"] if not rd["prefill"]]
        assert len(decode) * e["per_round_ms"]["wall"] / 1000 == pytest.approx(sum(rd["end"] - rd["start"] for rd in decode))
        if e["strategy"]:
            assert _added(x["strategy"] for x in mine) == e["strategy"]


def test_step_costs_cover_only_the_models_the_benched_modes_run(zoo_tiny):
    """`--modes ar` with the default `--draft` (zoo:small/draft) built the whole
    small family to time a draft no mode runs."""
    from saguaro_ray.bench.run import BenchArgs, _benched_models

    args = BenchArgs(
        target=str(zoo_tiny / "target"), draft="zoo:small/draft", qualifier="zoo:small/qualifier", modes=["ar", "hf-ar"],
        num_drafts=[1], prompts="code", max_tokens=[8], batch_sizes=[1], temperatures=[0.0], repeats=1,
    )
    assert _benched_models(args) == {"target": str(zoo_tiny / "target")}
    args.modes = ["ar", "ssd"]
    assert _benched_models(args) == {"target": str(zoo_tiny / "target"), "draft": "zoo:small/draft"}
    args.modes = ["pyramid"]
    assert set(_benched_models(args)) == {"target", "draft", "qualifier"}
    args.modes = ["hf-assisted"]
    assert set(_benched_models(args)) == {"target", "draft"}
    args.modes = ["ar", "sd:2", "auto"]  # auto's engine allows what is benched: no pyramid, so no qualifier
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
    assert "ZeroDivisionError" in report["boom"]["error"] and report["fine"]["x"] == 1.5 and "seconds" in report["fine"]
    assert gpu_check._failed(report["boom"]) and not gpu_check._failed(report["fine"])
    assert gpu_check._failed({"a": {"ssd_equals_ar": False}}) and gpu_check._failed({"returncode": 1})
    assert not gpu_check._failed({"skipped": "needs 2 GPUs"})
    target = str(save_tiny_checkpoint(tmp_path, "llama", seed=0, max_position_embeddings=4096))  # gpu_check's long prompt: ~2k characters
    models = {"target": target, "draft": target}
    got = gpu_check._end_to_end(models, ray=False, device="cpu")
    assert got["ok"] and got["ssd_tokens_per_s"] > 0 and got["seeded_ar_repeats"] and got["completed_sampled"]
    assert got["ssd_first_divergence"] == [None] * 4  # the long prompt's too
    started = not ray.is_initialized()
    try:
        got = gpu_check._end_to_end(models, ray=True, device="cpu")
        assert got["ok"] and got["ssd_data_plane"]["data_plane_generation"] >= 1
    finally:
        if started:
            ray.shutdown()


def _run(
    mode, runtime, rounds, accepted, spec_rounds, tokens_per_s, batch=1, temperature=0.0, strategy=None, k_total=0.0, k_rounds=0, num_drafts=1, sampling=None,
    max_tokens=64,
):
    from saguaro_ray.bench.report import RunResult, round_breakdown

    return RunResult(
        mode, runtime, num_drafts, batch, temperature, max_tokens, 1.0, 100, int(tokens_per_s), 1.0, accepted, spec_rounds, 0, 0, round_breakdown(rounds), rounds,
        strategy=strategy or {}, k_total=k_total, k_rounds=k_rounds, sampling=sampling,
    )


def _rounds(n, wall, verify, batch=1):
    return [{"index": i, "batch": batch, "start": i * wall, "end": (i + 1) * wall, "verify": [i * wall, i * wall + verify]} for i in range(n)]


def test_the_tail_is_the_share_of_decode_time_after_a_batchs_first_request_finished():
    """A cell at batch 4 over 7 prompts (a batch of 4, then one of 3): rounds with fewer
    sequences than their batch's first decode rounds are its tail, each prefill starts a batch
    afresh, and a last batch smaller than the cell's is no tail of its own."""
    from saguaro_ray.bench.report import summarise

    def batch(sizes):
        rounds = [{"index": 0, "batch": 4, "start": 0.0, "end": 5.0, "verify": None, "prefill": True}]  # not decode time
        rounds += [{**rd, "batch": n} for rd, n in zip(_rounds(len(sizes), 0.1, 0.05), sizes)]
        return rounds

    ssd = _run("ssd", "ray", batch([4, 4, 4, 3, 1]) + batch([3, 3, 2, 2, 2]), 0, 0, 100.0, batch=4)
    ar = _run("ar", "ray", batch([4] * 5) + batch([3] * 5), 0, 0, 100.0, batch=4)
    by = {e["mode"]: e for e in summarise([ar, ssd])}
    assert by["ssd"]["tail_fraction"] == pytest.approx(5 / 10)
    assert by["ar"]["tail_fraction"] == 0.0


def test_outputs_that_are_not_ars_are_counted_and_named():
    """The bench's exactness check compares each request with AR's of the same
    cell and seed; a row with one request off is named, a peer is compared at
    T = 0 only (its sampling draws from another stream)."""
    from saguaro_ray.bench.report import inexact_rows, summarise

    def run(mode, outputs, runtime="ray", temperature=0.0, seed=0, batch=1):
        r = _run(mode, runtime, _rounds(2, 0.004, 0.003), 0, 0, 100.0, batch=batch, temperature=temperature)
        r.outputs, r.seed = outputs, seed
        return r

    runs = [
        run("ar", [(1, 2), (3, 4)]), run("sd", [(1, 2), (3, 4)]), run("ssd", [(1, 2), (3, 5)]),
        run("ar", [(7, 8), (9, 9)], seed=1), run("ssd", [(7, 8), (9, 9)], seed=1),  # a second repeat: its own reference
        run("ar", [(1, 1), (2, 2)], temperature=0.7), run("sd", [(1, 1), (2, 2)], temperature=0.7),
        run("hf-ar", [(1, 2), (3, 0)], runtime="hf"), run("hf-ar", [(5, 5), (6, 6)], runtime="hf", temperature=0.7),
        run("sd", [(1, 2), (3, 4)], batch=2),  # no AR at batch 2: nothing to compare with
    ]
    by = {(e["mode"], e["temperature"], e["runtime"], e["batch_size"]): e["same_as_ar"] for e in summarise(runs)}
    assert by["ar", 0.0, "ray", 1] is None
    assert by["sd", 0.0, "ray", 1] == {"equal": 2, "of": 2} and by["sd", 0.7, "ray", 1] == {"equal": 2, "of": 2}
    assert by["ssd", 0.0, "ray", 1] == {"equal": 3, "of": 4}
    assert by["hf-ar", 0.0, "hf", 1] == {"equal": 1, "of": 2} and by["hf-ar", 0.7, "hf", 1] is None
    assert by["sd", 0.0, "ray", 2] is None
    assert inexact_rows(summarise(runs)) == ["ssd (ray) 64 tokens batch 1 T 0: 3/4 equal"]  # the peer's near-tie is reported, not a breach


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
        num_drafts=[1], prompts="humaneval", max_tokens=[8], batch_sizes=[1, 2], temperatures=[0.0], repeats=1,
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


def test_mode_labels_parse_into_request_strategies_and_bad_ones_fail_in_one_line(zoo_tiny, monkeypatch, capsys):
    import saguaro_ray.bench.run
    from saguaro_ray.bench.plan import parse_modes
    from saguaro_ray.cli import main
    from saguaro_ray.config import Strategy

    modes = parse_modes(["ar", "sd:2", "sd", "ssd:6", "auto", "pyramid", "hf-ar"])
    assert [m.strategy for m in modes] == [Strategy("ar"), Strategy("sd", 2), Strategy("sd"), Strategy("ssd", 6), Strategy("auto"), Strategy("pyramid"), None]
    assert [m.mode for m in modes] == ["ar", "sd", "sd", "ssd", "auto", "pyramid", "hf-ar"]
    ran = []
    monkeypatch.setattr(saguaro_ray.bench.run, "run_bench", lambda args: ran.append(args))
    for bad, says in [("ar:2", "only sd and ssd take a K"), ("sd:0", "positive integer"), ("sd:x", "positive integer"),
                      ("sdd", "unknown mode 'sdd'"), ("ar,sd,ar", "names ar more than once")]:  # fmt: skip
        code = main(["bench", "--target", str(zoo_tiny / "target"), "--draft", str(zoo_tiny / "draft"), "--modes", bad])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and says in err and "--modes" in err, (bad, err)
    code = main(["bench", "--target", str(zoo_tiny / "target"), "--mixed", "0.7"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--mixed needs at least two different temperatures" in err
    for flag in ("--max-tokens", "--batch-sizes"):
        code = main(["bench", "--target", str(zoo_tiny / "target"), flag, "64,0"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and flag in err and "must be positive" in err
    for flag in ("--json", "--markdown", "--rounds"):  # a report with nowhere to go fails before the hours of running
        code = main(["bench", "--target", str(zoo_tiny / "target"), flag, str(zoo_tiny / "no-such-folder" / "out")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and flag in err and "does not exist or is not writable" in err
    assert not ran  # every bad command failed before an engine started


def test_one_engine_per_runtime_serves_every_mode_and_ssd_gets_one_per_num_drafts(zoo_tiny):
    from saguaro_ray.bench.plan import parse_modes
    from saguaro_ray.bench.run import BenchArgs, engine_plan, engine_spec

    modes = parse_modes(["ar", "sd:2", "sd:6", "ssd", "auto", "hf-ar"])
    plan = engine_plan(modes, [1])
    assert [(nd, [m.label for m in ms]) for nd, ms in plan] == [(1, ["ar", "sd:2", "sd:6", "ssd", "auto"])]
    plan = engine_plan(modes, [1, 2])
    assert [(nd, [m.label for m in ms]) for nd, ms in plan] == [(1, ["ar", "sd:2", "sd:6", "ssd", "auto"]), (2, ["ssd"])]
    assert [nd for nd, _ in engine_plan(parse_modes(["ssd"]), [2])] == [2]  # --num-drafts 2 alone: no one-draft engine
    args = BenchArgs(
        target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), qualifier=None, modes=[], num_drafts=[1],
        prompts="code", max_tokens=[8], batch_sizes=[1], temperatures=[0.0], repeats=1,
    )
    spec = engine_spec(plan[0][1], args)
    assert spec.mode == "auto" and spec.allow == ("ar", "sd", "ssd", "auto")
    assert spec.max_k is None  # the default ceiling covers K = 6: auto's ceiling is left alone
    wide = engine_spec(parse_modes(["ar", "sd:12"]), args)
    assert wide.mode == "ar" and wide.allow == ("ar", "sd") and wide.k_max == 12


def test_a_mixed_cell_runs_half_its_requests_at_each_temperature_in_every_batch():
    from saguaro_ray.bench.plan import temperature_settings
    from saguaro_ray.bench.run import request_params
    from saguaro_ray.config import Strategy

    settings = temperature_settings([0.0, 0.7], [0.0, 0.7])
    assert [s.label for s in settings] == [0.0, 0.7, "mix:0,0.7"]
    params = request_params(8, settings[-1], 16, 3, Strategy("sd", 2))
    for b in (2, 4, 8):  # a run submits its requests b at a time
        for i in range(0, 8, b):
            temps = [p.temperature for p in params[i : i + b]]
            assert sorted(temps) == [0.0] * (b // 2) + [0.7] * (b // 2)
    assert all(p.speculation == Strategy("sd", 2) and p.max_tokens == 16 and p.seed == 3 and p.ignore_eos for p in params)
    assert {p.temperature for p in request_params(4, settings[0], 16, 0, None)} == {0.0}


def test_a_cell_runs_batch_by_batch_with_the_modes_taking_turns():
    """Each batch of a cell is generated by every runner, in an order that
    rotates from batch to batch (no mode always first or last on a drifting
    machine), each batch knowing its first request's index (the mix's
    temperatures and the peers' seeds follow it); a runner's batches add up to
    its one run of the cell, and each batch is recorded (``--rounds``) with its
    first prompt; the turns go on across repeats, so a batch of every
    prompt does not always put the same runner first."""
    from saguaro_ray.bench.plan import SamplingSetting, temperature_settings
    from saguaro_ray.bench.run import _run_cell

    calls = []

    class Recorder:
        def __init__(self, mode, runtime="ray"):
            self.mode, self.runtime = mode, runtime

        def run(self, prompts, t, max_tokens, seed, batch_size, sampling=None, first=0):
            calls.append((self.mode, first, len(prompts)))
            r = _run(self.mode, self.runtime, _rounds(len(prompts), 0.004, 0.003, batch=batch_size), len(prompts), 1, 100.0,
                     batch=batch_size, strategy={"sd": 1}, k_total=4.0, k_rounds=1)
            r.outputs = [(first + i,) for i in range(len(prompts))]
            return r

    runners = [Recorder("ar"), Recorder("sd"), Recorder("auto")]
    mix = temperature_settings([], [0.0, 0.7])[0]
    recorded = []  # --rounds: each runner's batches, with their repeat and first prompt
    runs = _run_cell(runners, [f"p{i}" for i in range(7)], mix, SamplingSetting(), 16, 0, 3, lambda r, rep, first: recorded.append((r.mode, rep, first, r.outputs[0])))
    assert [c[0] for c in calls] == ["ar", "sd", "auto", "sd", "auto", "ar", "auto", "ar", "sd"]
    assert recorded == [(m, 0, first, (first,)) for m in ("ar", "sd", "auto") for first in (0, 3, 6)]
    assert {c[1:] for c in calls} == {(0, 3), (3, 3), (6, 1)}
    assert [r.mode for r in runs] == ["ar", "sd", "auto"]
    for r in runs:
        assert r.outputs == [(i,) for i in range(7)] and r.tokens == 300 and r.accepted == 7 and r.spec_rounds == 3
        assert r.breakdown["rounds"] == 7 and len(r.rounds) == 7 and r.strategy == {"sd": 3} and (r.k_total, r.k_rounds) == (12.0, 3)
    # one batch of every prompt: each repeat is one turn, and the turns go on across repeats
    calls.clear()
    for rep in range(3):
        _run_cell(runners, [f"p{i}" for i in range(3)], mix, SamplingSetting(), 16, rep, 3)
    assert [c[0] for c in calls] == ["ar", "sd", "auto", "sd", "auto", "ar", "auto", "ar", "sd"]


def test_ratios_are_taken_repeat_by_repeat_so_the_machines_drift_cancels():
    """Auto's and every mode's ratios pair the rows of one repeat (they ran
    interleaved): a machine at half speed for a whole repeat moves no ratio,
    while the ratio of the rows' medians would mix repeats. The spread over
    the repeats is kept, and the markdown table shows it."""
    from saguaro_ray.bench.report import markdown_table, summarise

    runs = []
    for seed, speeds in enumerate([{"ar": 300, "sd": 360, "auto": 330}, {"ar": 150, "sd": 180, "auto": 165}, {"ar": 200, "sd": 240, "auto": 100}]):
        for mode, tps in speeds.items():
            r = _run(mode, "ray", _rounds(2, 0.004, 0.003), 0, 0, tps, strategy={"ar": 2})
            r.decode_tokens, r.seed = tps, seed
            runs.append(r)
    entries = summarise(runs)
    auto, sd = (next(e for e in entries if e["mode"] == m) for m in ("auto", "sd"))
    assert auto["tokens_per_s"] == 165 and sd["tokens_per_s"] == 240  # medians: 165 / 240 would be 0.69
    assert (auto["auto_vs_best"], auto["auto_vs_best_min"], auto["auto_vs_best_max"]) == pytest.approx((330 / 360, 100 / 240, 330 / 360))
    assert (auto["auto_vs_ar"], auto["auto_vs_ar_min"], auto["auto_vs_ar_max"]) == pytest.approx((1.1, 0.5, 1.1))
    assert sd["speedup_vs_ar"] == pytest.approx(1.2) and sd["auto_vs_best"] is None
    assert "| 0.92 [0.42–0.92] (sd) | 1.10 [0.50–1.10] |" in markdown_table(entries)


def test_what_requests_ran_is_summed_from_their_stats():
    from saguaro_ray.bench.run import chosen_strategies

    stats = [
        {"strategy": {"ar": 2, "sd": 3}, "mean_accepted": 2.0, "mean_k": 4.0},
        {"strategy": {"ar": 5}, "mean_accepted": None, "mean_k": None},
        {"strategy": {"ssd": 1}, "mean_accepted": 1.0, "mean_k": 2.0},
    ]
    assert chosen_strategies(stats) == {"strategy": {"ar": 7, "sd": 3, "ssd": 1}, "k_total": 14.0, "k_rounds": 4}


def test_every_cell_names_its_best_fixed_mode_and_auto_is_compared_with_it():
    from saguaro_ray.bench.report import auto_note, format_table, markdown_table, summarise

    rounds = _rounds(4, 0.004, 0.003)
    runs = []
    for t, speeds in [(0.0, {"ar": 300, "sd:2": 420, "ssd": 390, "auto": 410}), ("mix:0,0.7", {"ar": 300, "sd:2": 280, "ssd": 330, "auto": 360})]:
        for mode, tps in speeds.items():
            chose = {"auto": {"ar": 1, "sd": 3}, "sd:2": {"sd": 4}}.get(mode, {})
            spec = sum(n for m, n in chose.items() if m != "ar")
            runs.append(_run(mode, "ray", rounds, 2 * spec, spec, tps, temperature=t, strategy=chose, k_total=3.0 * spec, k_rounds=spec))
    runs.append(_run("ssd", "ray", rounds, 0, 0, 1000, temperature=0.0, num_drafts=2))  # an SSD with two drafts: a fixed mode too
    runs.append(_run("hf-ar", "hf", [], 0, 0, 999, temperature=0.0))  # a peer never counts as a fixed mode
    entries = summarise(runs)
    for t in (0.0, "mix:0,0.7"):
        cell = [e for e in entries if e["temperature"] == t and e["runtime"] == "ray"]
        fixed = [e for e in cell if e["mode"] != "auto"]
        best = max(fixed, key=lambda e: e["tokens_per_s"])
        auto = next(e for e in cell if e["mode"] == "auto")
        ar = next(e for e in cell if e["mode"] == "ar")
        name = best["mode"] if best["num_drafts"] == 1 else f"{best['mode']}/d{best['num_drafts']}"
        assert all(e["best_fixed"] == name for e in cell)
        assert auto["auto_vs_best"] == pytest.approx(auto["tokens_per_s"] / best["tokens_per_s"])
        assert auto["auto_vs_ar"] == pytest.approx(auto["tokens_per_s"] / ar["tokens_per_s"])
        assert all(e["auto_vs_best"] is None and e["auto_vs_ar"] is None for e in fixed)
        assert auto["strategy"] == {"ar": 1, "sd": 3} and auto["mean_k"] == pytest.approx(3.0) and auto["mean_accepted"] == pytest.approx(2.0)
        assert f"best {name} {auto['auto_vs_best']:.2f}x" in auto_note(auto) and "chose sd 75%, ar 25%" in auto_note(auto)
    peer = next(e for e in entries if e["runtime"] == "hf")
    assert peer["best_fixed"] is None and peer["strategy"] is None and peer["mean_k"] is None
    table = format_table({"results": entries})
    assert "mix:0,0.7" in table and sum("best " in line for line in table.splitlines()) == 2
    md = markdown_table(entries).splitlines()  # the README's: the peer joins its cell's row, the two-draft SSD is a row of its own
    assert md[0] == "| num_drafts, batch, T | ar | sd:2 | ssd | auto | hf-ar | auto / best fixed | auto / AR | auto chose |"
    assert md[2] == "| 1, 1, 0 | 300.0 | 420.0 | 390.0 | 410.0 | 999.0 | 0.41 (ssd/d2) | 1.37 | sd 75 %, ar 25 %, K 3.0 |"
    assert md[3].startswith("| 1, 1, mixed 0/0.7 | 300.0 | 280.0 | 330.0 | 360.0 | – | 1.09 (ssd) | 1.20 |")
    assert md[4] == "| 2, 1, 0 | – | – | 1000.0 | – | 999.0 | – | – | – |"


def test_each_request_length_is_a_cell_of_its_own():
    """``--max-tokens 64,256`` benches both lengths in one run: each length's rows are
    compared with that length's alone (best fixed mode, AR, the exactness check), the
    Markdown table gets a tokens column, and a peer joins the rows of its own length."""
    from saguaro_ray.bench.report import format_table, markdown_table, summarise

    runs = []
    for n, speeds in [(64, {"ar": 300, "ssd": 390, "auto": 380}), (256, {"ar": 310, "ssd": 600, "auto": 590})]:
        for mode, tps in speeds.items():
            r = _run(mode, "ray", _rounds(2, 0.004, 0.003), 0, 0, tps, max_tokens=n)
            r.outputs = [(n,)] if mode != "ssd" or n == 64 else [(0,)]  # the long SSD row is off AR's tokens
            runs.append(r)
    runs.append(_run("hf-ar", "hf", [], 0, 0, 100, max_tokens=256))
    entries = summarise(runs)
    by = {(e["mode"], e["max_tokens"]): e for e in entries}
    assert by["auto", 64]["auto_vs_best"] == pytest.approx(380 / 390) and by["auto", 256]["auto_vs_best"] == pytest.approx(590 / 600)
    assert by["auto", 64]["auto_vs_ar"] == pytest.approx(380 / 300) and by["hf-ar", 256]["speedup_vs_ar"] == pytest.approx(100 / 310)
    assert by["ssd", 64]["same_as_ar"] == {"equal": 1, "of": 1} and by["ssd", 256]["same_as_ar"] == {"equal": 0, "of": 1}
    md = markdown_table(entries).splitlines()
    assert md[0] == "| tokens, batch, T | ar | ssd | auto | hf-ar | auto / best fixed | auto / AR | auto chose |"
    assert md[2].startswith("| 64, 1, 0 | 300.0 | 390.0 | 380.0 | – | 0.97 (ssd) |")
    assert md[3].startswith("| 256, 1, 0 | 310.0 | 600.0 | 590.0 | 100.0 | 0.98 (ssd) |")
    assert len(md) == 4 and "   256" in format_table({"results": entries})
    one = markdown_table([e for e in entries if e["max_tokens"] == 64]).splitlines()  # one length: no column for it
    assert one[0].startswith("| batch, T | ar |")


def test_auto_rows_report_their_prediction_error_from_the_timeline():
    """Each auto round records what auto predicted (its choice and the runner-up); the
    report compares the choice's predicted seconds and tokens with what the round took."""
    from saguaro_ray.bench.report import auto_note, summarise
    from saguaro_ray.engine.timeline import prediction_error

    rounds = _rounds(10, 0.004, 0.003)
    for i, rd in enumerate(rounds):
        rd["accepted"] = [2]  # 3 tokens emitted a round
        if i >= 2:  # the first two: no prediction (a cold start), not compared
            rd["auto"] = {"chosen": {"option": "sd:3", "tokens": 3.3, "seconds": 0.005, "verify": 0.0033}, "runner_up": None}
    rounds.append({**rounds[-1], "prefill": True})  # an admission round is no decode round
    # a round whose speculating pick ran AR while its drafts caught up: counted apart, not compared
    # ... it sent 24 tokens; a catch-up ran beside it and beside one other round
    rounds.append({**rounds[-2], "auto": {**rounds[-2]["auto"], "not_ready": 1}, "end": rounds[-2]["end"] + 1.0, "catch_up_sent": 24, "catching_up": 3})
    rounds[-3]["catching_up"] = 3
    pred = prediction_error(rounds)
    assert pred["rounds"] == 8 and pred["not_ready_rounds"] == 1 and pred["seconds_ratio"] == pytest.approx(1.25) and pred["seconds_error"] == pytest.approx(0.25)
    assert pred["catch_up_tokens"] == 24 and pred["catch_up_rounds"] == 2
    assert pred["tokens_error"] == pytest.approx(0.1) and pred["verify_ratio"] == pytest.approx(1.1)  # 3.3 ms predicted, 3 ms verified
    assert prediction_error(_rounds(3, 0.004, 0.003)) is None
    auto, sd = summarise([_run("auto", "ray", rounds, 16, 8, 500.0), _run("sd:3", "ray", rounds, 16, 8, 480.0)])
    assert auto["auto_prediction"] == pred and sd["auto_prediction"] is None
    assert "predicted/measured round time 1.25 (median error 25%), verification 1.10" in auto_note(auto)


def test_sampling_settings_are_cells_of_their_own(monkeypatch, capsys):
    """``--sampling`` (repeatable): each setting's requests carry its fields, and
    its rows are compared with the modes of the same setting only."""
    import saguaro_ray.bench.run
    from saguaro_ray.bench.plan import sampling_settings, temperature_settings
    from saguaro_ray.bench.report import format_table, summarise
    from saguaro_ray.bench.run import request_params
    from saguaro_ray.cli import main
    from saguaro_ray.errors import ConfigError

    ran = []
    monkeypatch.setattr(saguaro_ray.bench.run, "run_bench", lambda args: ran.append(args) or {"results": []})
    pen = '{"presence_penalty": 0.5, "logit_bias": {"5": -1}}'
    assert main(["bench", "--modes", "ar", "--sampling", "{}", "--sampling", pen]) == 0
    assert [a.sampling for a in ran] == [[{}, {"presence_penalty": 0.5, "logit_bias": {"5": -1}}]]
    for bad, says in [('{"seed": 1}', "the bench's own flags"), ('{"top_k": -1}', "top_k")]:
        code = main(["bench", "--modes", "ar", "--sampling", bad])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and says in err, (bad, err)
    with pytest.raises(SystemExit) as usage:  # not JSON: argparse's usage error, as for any flag of the wrong type
        main(["bench", "--modes", "ar", "--sampling", "[1]"])
    assert usage.value.code == 2 and "argument --sampling: must be a JSON object" in capsys.readouterr().err.splitlines()[-1]
    assert len(ran) == 1  # every bad command failed before an engine started

    plain, pen = sampling_settings([{}, {"presence_penalty": 0.5, "logit_bias": {"5": -1}, "top_k": 3}])
    assert [s.label for s in sampling_settings(None)] == [None] and plain.label is None
    assert pen.label == '{"logit_bias":{"5":-1},"presence_penalty":0.5,"top_k":3}'
    [p] = request_params(1, temperature_settings([0.7], None)[0], 16, 3, None, sampling=pen)
    assert (p.presence_penalty, p.logit_bias, p.top_k, p.temperature, p.max_tokens) == (0.5, ((5, -1.0),), 3, 0.7, 16)
    for bad, needle in [
        ([{"temperature": 1}], "the bench's own flags set"),
        ([{"penalty": 1}], r"unknown field\(s\) \['penalty'\]"),
        ([{"presence_penalty": 3}], "presence_penalty must be"),
        ([{"repetition_penalty": 1.1}, {"repetition_penalty": 1.1}], "more than once"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            sampling_settings(bad)
    rounds = _rounds(4, 0.004, 0.003)
    runs = [_run("ar", "ray", rounds, 0, 0, 300), _run("sd", "ray", rounds, 4, 4, 450), _run("ar", "ray", rounds, 0, 0, 200, sampling=pen.label),
            _run("sd", "ray", rounds, 4, 4, 400, sampling=pen.label)]  # fmt: skip
    entries = summarise(runs)
    assert [(e["mode"], e["sampling"], e["speedup_vs_ar"]) for e in entries] == [
        ("ar", None, 1.0), ("sd", None, 1.5), ("ar", pen.label, 1.0), ("sd", pen.label, 2.0),
    ]
    assert sum(f"sampling {pen.label}" in line for line in format_table({"results": entries}).splitlines()) == 2

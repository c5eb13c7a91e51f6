"""The benchmark harness produces the documented JSON and a plot (no timing asserted)."""

import json
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
         "--repeats", "1", "--runtimes", "inprocess", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    assert {"machine", "results", "step_costs_ms"} <= set(report)
    assert report["machine"]["cpu_count"] >= 1
    results = report["results"]
    assert len(results) == 3 * 2 * 2
    for e in results:
        assert RESULT_KEYS <= set(e)
        assert e["tokens_per_s"] > 0
        if e["mode"] == "ar":
            assert e["speedup_vs_ar"] == 1.0 and e["mean_accepted"] is None
        assert e["hops_ms"]["send"] is not None and e["hops_ms"]["reply"] is not None
        if e["mode"] == "ssd":
            assert 0 <= e["cache_hit_rate"] <= 1 and e["efficiency"] > 0
            assert None not in (e["hops_ms"]["bookkeeping"], e["hops_ms"]["lookup_send"], e["hops_ms"]["lookup_reply"])
        else:
            assert e["cache_hit_rate"] is None and e["efficiency"] is None
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in proc.stdout


def test_text_prompts_come_from_heldout_docstrings(zoo_tiny):
    from saguaro_ray.bench import load_prompts
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

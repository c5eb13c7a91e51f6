"""``saguaro-ray demo``: every mode side by side, one answer, exactness reported."""

import subprocess
import sys


def test_demo_runs_every_mode_on_one_engine_and_reports_same_tokens(zoo_tiny):
    proc = subprocess.run(
        [sys.executable, "-m", "saguaro_ray", "demo", "--family", "zoo:tiny", "--in-process", "--prompts", "2", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--- its answer" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["ar"], ["sd"], ["ssd"], ["pyramid"], ["auto"])]
    assert [r[0] for r in rows] == ["ar", "sd", "ssd", "pyramid", "auto"] and all(r[-1] == "yes" for r in rows)
    assert "what auto chose" in out


def test_demo_refuses_a_batch_below_one_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "saguaro_ray", "demo", "--batch", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "batch must be at least 1, got 0" in proc.stderr and "Traceback" not in proc.stderr

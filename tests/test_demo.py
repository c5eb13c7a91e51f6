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


def test_demo_families():
    """The default is SmolLM2 with its own int4/int8 copies; the Qwen2.5-Coder
    pair (the 0.5B quantised at load as the draft, the 1.5B's own int4 copy as
    PyramidSD's qualifier) and the zoo families are named; an unknown family is
    one line, before anything loads."""
    from saguaro_ray import cli
    from saguaro_ray.demo import DEFAULT_FAMILY, family_models

    assert cli.build_parser().parse_args(["demo"]).family == DEFAULT_FAMILY == "coder"
    assert family_models("coder") == {
        "target": "real:qwen2.5-coder-1.5b-instruct",
        "draft": "int4:real:qwen2.5-coder-0.5b-instruct",
        "qualifier": "self:int4",
    }
    assert family_models("smollm2") == {"target": "real:smollm2-135m-instruct", "draft": "self:int4", "qualifier": "self:int8"}
    assert family_models("zoo:tiny")["draft"] == "zoo:tiny/draft"
    proc = subprocess.run([sys.executable, "-m", "saguaro_ray", "demo", "--family", "real"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "saguaro-ray: error: unknown demo family 'real': expected one of coder, smollm2, zoo:tiny, zoo:small"
    ]

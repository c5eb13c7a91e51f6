"""``python -m saguaro_ray.jobs.gpu_check`` — the checks that need a CUDA device.

On a machine with CUDA it (1) runs the GPU-marked tests (runner parity on
CUDA with torch SDPA, and flash-attn when importable), (2) times the target's
8-token verify and the draft's tree-decode step per attention backend, and
(3) runs the engine end to end with target and draft sharing the one GPU,
checking SSD's tokens against AR's; (4) with two or more GPUs, runs the Ray
engine with the target sharded over two GPUs (``target_tp=2``, NCCL) and
checks its AR tokens (and SSD's, given a third GPU for the draft) against
the unsharded target's, and measures each rank's peak load memory. It prints one JSON report (and writes it
with ``--json``). Without CUDA it says so and exits 0: nothing to check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m saguaro_ray.jobs.gpu_check")
    parser.add_argument("--preset", default="tiny", help="zoo family for timings and the end-to-end run")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (skipped)")
        return 0
    from saguaro_ray.bench import step_costs
    from saguaro_ray.config import SamplingParams, SpeculationConfig
    from saguaro_ray.engine import LocalEngine, LocalEngineConfig
    from saguaro_ray.zoo import build_family, zoo_root

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import flash_attn

        report["flash_attn"] = flash_attn.__version__
    except ImportError:
        report["flash_attn"] = None
    if not args.skip_tests:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], capture_output=True, text=True)
        report["gpu_tests"] = {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:]}
    build_family(args.preset)
    fam = zoo_root() / args.preset
    models = {"target": str(fam / "target"), "draft": str(fam / "draft")}
    report["step_costs_ms"] = {"bf16": step_costs(models, device="cuda", dtype="bf16")}
    prompts = ["def main(", "import os\n", "class Parser:"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for mode in ("ar", "ssd"):
        engine = LocalEngine(
            LocalEngineConfig(target=models["target"], draft=models["draft"], spec=SpeculationConfig(mode=mode, k=4, budget=8), device="cuda", dtype="fp32")
        )
        try:
            tokens[mode] = [r.token_ids for r in engine.generate(prompts, params)]
        finally:
            engine.close()
    report["end_to_end_ssd_equals_ar"] = tokens["ssd"] == tokens["ar"]
    report["tensor_parallel"] = tensor_parallel_check(models, prompts, params, tokens["ar"])
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    ok = (
        report["end_to_end_ssd_equals_ar"]
        and report.get("gpu_tests", {}).get("returncode", 0) == 0
        and report["tensor_parallel"].get("ok", True)
    )
    return 0 if ok else 1


def tensor_parallel_check(models: dict[str, str], prompts: list[str], params: Any, reference: list[list[int]]) -> dict[str, Any]:
    """T = 2 over NCCL through the Ray engine: the same greedy tokens as T = 1 (fp32)."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"target_tp=2 needs 2 GPUs, found {gpus}"}
    from saguaro_ray import Engine, EngineConfig
    from saguaro_ray.config import SpeculationConfig

    out: dict[str, Any] = {"gpus": gpus}
    modes = ["ar", "ssd"] if gpus >= 3 else ["ar"]  # one GPU per rank, one for the draft
    for mode in modes:
        config = EngineConfig(
            target=models["target"],
            draft=models["draft"],
            spec=SpeculationConfig(mode=mode, k=4, budget=8),
            device="cuda",
            dtype="fp32",
            target_tp=2,
            address="local",
        )
        handle = Engine.launch(config)
        try:
            out[f"{mode}_tp2_equals_tp1"] = [r.token_ids for r in handle.generate(prompts, params)] == reference
        finally:
            handle.shutdown()
    proc = subprocess.run(
        [sys.executable, "-m", "saguaro_ray.jobs.tp_memory", "--model", models["target"], "--tp", "1", "2", "--device", "cuda"],
        capture_output=True,
        text=True,
    )
    out["load_memory"] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out["ok"] = all(v for k, v in out.items() if k.endswith("_equals_tp1"))
    return out


if __name__ == "__main__":
    sys.exit(main())

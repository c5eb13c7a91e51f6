"""``python -m saguaro_ray.jobs.gpu_check`` — the checks that need a CUDA device.

On a machine with CUDA it (1) runs the GPU-marked tests (runner parity on
CUDA with torch SDPA, and flash-attn when importable), (2) times the target's
8-token verify and the draft's tree-decode step per attention backend, (3)
runs the engine end to end with target and draft sharing the one GPU —
in process, and through Ray actors that each ask for half of it — checking
SSD's tokens against AR's, with the tokens/s of each mode; and (4) with two
or more GPUs, runs the Ray engine with the target sharded over two GPUs
(``target_tp=2``, NCCL) and checks its AR tokens (and SSD's, given a third
GPU for the draft) against the unsharded target's, and measures each rank's
peak load memory.

Device time is scarce, so every section runs even if another failed: a
failure is recorded in the report (``{"error": ...}``) and makes the exit
status 1. It prints one JSON report (and writes it with ``--json``).
Without CUDA it says so and exits 0: nothing to check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

from saguaro_ray.config import SamplingParams

PROMPTS = ["def main(", "import os\n", "class Parser:"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # greedy: every mode's tokens are AR's


def _section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one check; its result, or the error it raised, goes under ``name``."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 — report it and go on to the next check
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(f"gpu_check: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _failed(value: Any) -> bool:
    """Did a section fail (an error, a False check, a non-zero test run)?"""
    if isinstance(value, dict):
        if "error" in value or value.get("ok") is False or value.get("returncode", 0) != 0:
            return True
        return any(_failed(v) for v in value.values())
    return value is False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m saguaro_ray.jobs.gpu_check")
    parser.add_argument("--preset", default="tiny", help="zoo family for timings and the end-to-end runs")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-ray", action="store_true", help="no Ray runs (shared GPU, tensor parallel)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (skipped)")
        return 0
    from saguaro_ray.zoo import build_family, zoo_root

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import flash_attn

        report["flash_attn"] = flash_attn.__version__
    except ImportError:
        report["flash_attn"] = None
    if not args.skip_tests:
        _section(report, "gpu_tests", _gpu_tests)
    build_family(args.preset)
    fam = zoo_root() / args.preset
    models = {"target": str(fam / "target"), "draft": str(fam / "draft")}
    backends = ["torch"] + (["flash_attn"] if report["flash_attn"] else [])
    _section(report, "step_costs_ms", lambda: _step_costs(models, backends))
    _section(report, "in_process", lambda: _end_to_end(models, ray=False))
    if not args.skip_ray:
        _section(report, "ray_shared_gpu", lambda: _end_to_end(models, ray=True))
        _section(report, "tensor_parallel", lambda: tensor_parallel_check(models))
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    return 1 if any(_failed(v) for v in report.values()) else 0


def _gpu_tests() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], capture_output=True, text=True)
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:]}


def _step_costs(models: dict[str, str], backends: list[str]) -> dict[str, Any]:
    """Per attention backend: bf16 decode, 8-token verify and 8-branch tree step (ms)."""
    from saguaro_ray.bench import step_costs

    return {b: step_costs(models, device="cuda", dtype="bf16", attention_backend=b) for b in backends}


def _end_to_end(models: dict[str, str], ray: bool, device: str = "cuda") -> dict[str, Any]:
    """AR, SD and SSD with target and draft on the one GPU (fp32): SSD's and
    SD's greedy tokens equal AR's; tokens/s per mode (after a warm-up call).
    ``ray``: through the Ray engine, each worker actor on half the GPU.
    (``device="cpu"`` is the dry run the tests make of this code.)"""
    from saguaro_ray import EngineConfig
    from saguaro_ray.config import SpeculationConfig

    out: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for mode in ("ar", "sd", "ssd"):
        spec = SpeculationConfig(mode=mode, k=4, budget=8)
        config = EngineConfig(target=models["target"], draft=models["draft"], spec=spec, device=device, dtype="fp32", gpus_per_worker=0.5, address="local")
        if ray:
            from saguaro_ray import Engine

            engine: Any = Engine.launch(config)
            close = engine.shutdown
        else:
            from saguaro_ray.engine import LocalEngine

            engine = LocalEngine(config)
            close = engine.close
        try:
            engine.generate(PROMPTS[:1], PARAMS)  # warm-up (CUDA context, kernels)
            t0 = time.perf_counter()
            results = engine.generate(PROMPTS, PARAMS)
            seconds = time.perf_counter() - t0
            tokens[mode] = [r.token_ids for r in results]
            out[f"{mode}_tokens_per_s"] = sum(len(t) for t in tokens[mode]) / seconds
            if ray:
                out[f"{mode}_data_plane_generation"] = engine.metrics().get("data_plane_generation")
        finally:
            close()
    out["sd_equals_ar"] = tokens["sd"] == tokens["ar"]
    out["ssd_equals_ar"] = tokens["ssd"] == tokens["ar"]
    out["ok"] = out["sd_equals_ar"] and out["ssd_equals_ar"]
    return out


def tensor_parallel_check(models: dict[str, str]) -> dict[str, Any]:
    """T = 2 over NCCL through the Ray engine: the same greedy tokens as T = 1 (fp32)."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"target_tp=2 needs 2 GPUs, found {gpus}"}
    from saguaro_ray import Engine, EngineConfig
    from saguaro_ray.config import SpeculationConfig
    from saguaro_ray.engine import LocalEngine

    ref = LocalEngine(EngineConfig(target=models["target"], spec=SpeculationConfig(mode="ar"), device="cuda", dtype="fp32"))
    try:
        reference = [r.token_ids for r in ref.generate(PROMPTS, PARAMS)]
    finally:
        ref.close()
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
            out[f"{mode}_tp2_equals_tp1"] = [r.token_ids for r in handle.generate(PROMPTS, PARAMS)] == reference
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

"""``python -m saguaro_ray.jobs.gpu_check`` — the checks that need a CUDA device.

Built for the GPU machine this project can borrow: one GPU, torch and
transformers but no Ray, no ZeroMQ, no flash-attn and no network, for about
a quarter of an hour. So by default it runs in one process through the
in-process engine and imports nothing of the distributed runtime (the report
says so, and fails if it did):

1. ``gpu_tests`` — the GPU-marked tests that need no Ray (runner parity on
   CUDA, CUDA graphs against eager steps, the device-placement tests);
2. ``attention_parity`` — the chosen attention backend in bf16 (and fp32)
   against transformers' own model on the same GPU, over a context past
   several KV blocks;
3. ``end_to_end`` — AR, SD and SSD on one engine in fp32 and bf16: at T = 0
   SD's and SSD's tokens must equal AR's (fp32; bf16 reports near-tie
   divergences), at T = 0.8 with a seed AR must repeat itself and every mode
   complete; one prompt runs past the first context bucket; AR with CUDA
   graphs must give the eager run's tokens;
4. ``step_costs`` — at the real sizes of the Qwen2.5-Coder pair (1.5B target,
   0.5B draft; random weights, which cost the same), bf16: decode and (K+1)
   verify at batch 1 and 8, eager against graphed, and tree steps of 1-16
   branches;
5. ``ssd_overlap`` — the target's verify and the draft's tree build (K steps)
   alone and at once on two CUDA streams: how much of the build hides.

``--ray`` adds the old Ray sections (target and draft as actors sharing the
GPU; tensor parallelism on 2+ GPUs) where Ray is installed; they fail when
the NCCL data plane did not form.

Device time is scarce, so every section runs even if another failed: a
failure is recorded in the report (``{"error": ...}``, or ``ok: false``) and
makes the exit status 1. It prints one JSON report (and writes it with
``--json``). Without CUDA it says so and exits 0: nothing to check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from saguaro_ray.config import SamplingParams

PROMPTS = ["def main(", "import os\n", "class Parser:"]
# past the first context bucket of the graphed steps (256 keys) and many 16-token KV blocks
LONG_PROMPT = "\n".join(f"def step_{i}(x):\n    return x * {i} + {i % 7}  # step {i}" for i in range(40)) + "\ndef main("
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # every mode's tokens are AR's
SAMPLED = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=1234)
# Qwen2.5-Coder-1.5B/0.5B-Instruct as their config.json gives them (DESIGN §7): the step-cost shapes
CODER_SHAPES: dict[str, dict[str, Any]] = {
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
}
CODER_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
GPU_TEST_FILES = ["tests/test_parity.py", "tests/test_step_graphs.py", "tests/test_device_placement.py"]
DISTRIBUTED = ("ray", "zmq")  # what the default sections must not import


def _section(report: dict[str, Any], name: str, fn: Callable[[], Any], path: str | None = None) -> None:
    """Run one check; its result, or the error it raised, goes under ``name``.
    With ``path`` the report so far is written there after every section, so a
    run cut short by its time limit still leaves what it measured."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 — report it and go on to the next check
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    seconds = time.perf_counter() - t0
    if isinstance(report[name], dict):
        report[name]["seconds"] = round(seconds, 1)
    print(f"gpu_check: {name} done in {seconds:.1f} s: {json.dumps(report[name], default=str)[:1500]}", file=sys.stderr, flush=True)
    if path:
        Path(path).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")


def _failed(value: Any) -> bool:
    """Did a section fail (an error, a False check, a non-zero test run)?"""
    if isinstance(value, dict):
        if "error" in value or value.get("ok") is False or value.get("returncode", 0) != 0:
            return True
        return any(_failed(v) for v in value.values())
    return value is False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m saguaro_ray.jobs.gpu_check")
    parser.add_argument("--preset", default="tiny", help="zoo family for the end-to-end runs (built, or read from $SAGUARO_ZOO_DIR)")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-real-sizes", action="store_true", help="no step costs or overlap at the Qwen2.5-Coder sizes")
    parser.add_argument("--ray", action="store_true", help="also the Ray sections (shared GPU, tensor parallel): needs Ray")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (skipped)")
        return 0
    from saguaro_ray.zoo import build_family, zoo_root

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import flash_attn

        report["flash_attn"] = flash_attn.__version__
    except ImportError:
        report["flash_attn"] = None
    build_family(args.preset)
    fam = zoo_root() / args.preset
    models = {"target": str(fam / "target"), "draft": str(fam / "draft")}
    section = lambda name, fn: _section(report, name, fn, args.json)  # noqa: E731
    if not args.skip_tests:
        section("gpu_tests", _gpu_tests)
    section("attention_parity", lambda: attention_parity(models["target"]))
    section("end_to_end", lambda: {dt: _end_to_end(models, dtype=dt) for dt in ("fp32", "bf16")})
    section("zoo_step_ms", lambda: zoo_steps(models["target"]))
    if not args.skip_real_sizes:
        with tempfile.TemporaryDirectory(prefix="gpu_check_models_") as tmp:
            real: dict[str, Any] = {}
            section("real_size_models", lambda: real.update(_real_size_models(Path(tmp))) or {"roles": sorted(real)})
            if real:
                section("step_costs", lambda: step_costs(real))
                section("ssd_overlap", lambda: ssd_overlap(real))
    if args.ray:
        section("ray_shared_gpu", lambda: _end_to_end(models, dtype="fp32", ray=True))
        section("tensor_parallel", lambda: tensor_parallel_check(models))
    else:
        imported = sorted(m for m in DISTRIBUTED if m in sys.modules)
        section("in_process_only", lambda: {"imported": imported, "ok": not imported})
    print(json.dumps(report, indent=1, default=str))
    return 1 if any(_failed(v) for v in report.values()) else 0


def _gpu_tests() -> dict[str, Any]:
    """The GPU-marked tests of the modules that import no distributed runtime
    (``-rA``: every test's outcome; the failures' tracebacks are kept)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TEST_FILES]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    return {
        "returncode": proc.returncode,
        "summary": lines[-1:],
        "outcomes": [ln for ln in lines if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))][:60],
        "output_tail": proc.stdout[-6000:] if proc.returncode else "",
    }


def _graph_errors(*runners: Any) -> list[str]:
    """Why a runner's CUDA graph capture failed, if one did (it then ran eagerly)."""
    return [r.graphs.capture_error for r in runners if r.graphs is not None and r.graphs.capture_error]


def _timed(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the GPU (synchronised around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(samples), 3)


def attention_parity(target: str) -> dict[str, Any]:
    """Our runner (the backend ``auto`` picks) against transformers' model on
    the same GPU and dtype, every position of a prompt past several blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    from saguaro_ray.tokenizer import load_tokenizer
    from saguaro_ray.workers.runner import ModelRunner

    ids = load_tokenizer(target).encode(LONG_PROMPT)[:300]
    out: dict[str, Any] = {"tokens": len(ids)}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        ref_model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to("cuda").eval()
        with torch.inference_mode():
            ref = ref_model(torch.tensor([ids], device="cuda")).logits[0].float()
        del ref_model
        runner = ModelRunner(target, device="cuda", dtype=dtype)
        runner.add_sequence(0)
        got = runner.forward([0], [ids[:200]], all_logits=True)
        steps = [runner.forward([0], [[t]]) for t in ids[200:216]]  # graphed decode steps past the prefill
        got = torch.cat([got, *steps])
        want = ref[: got.shape[0]]
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        diff = float((got - want).abs().max())
        bound = 0.97 if name == "bf16" else 0.999
        errors = _graph_errors(runner)
        captured = runner.graphs.captured if runner.graphs is not None else 0
        out[name] = {
            "backend": runner.backend.name, "argmax_agreement": round(agree, 4), "max_abs_diff": round(diff, 4),
            "graphs_captured": captured, "graph_errors": errors, "ok": agree >= bound and not errors and captured > 0,
        }
        del runner
        torch.cuda.empty_cache()
    return out


def zoo_steps(target: str, context: int = 300) -> dict[str, Any]:
    """Median ms of the zoo target's decode (batch 4) per dtype, eager and
    graphed, and in bf16 eager also without cuDNN's attention (which builds a
    plan per new shape): what the end-to-end tokens/s are made of."""
    import torch

    from saguaro_ray.workers.runner import ModelRunner

    out: dict[str, float] = {}
    for dtype in ("fp32", "bf16"):
        for graphs in (False, True):
            runner = ModelRunner(target, device="cuda", dtype=dtype, cuda_graphs=graphs)
            for s in range(4):
                runner.add_sequence(s)
                runner.forward([s], [[(5 * i + s) % 1000 for i in range(context + s)]])
            grow = [0]

            def decode() -> None:
                runner.forward([0, 1, 2, 3], [[7]] * 4)  # contexts grow: a new length every step, as in decoding
                grow[0] += 1

            out[f"{dtype}_{'graphed' if graphs else 'eager'}_b4"] = _timed(decode)
            if dtype == "bf16" and not graphs and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
                was = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
                try:
                    out["bf16_eager_b4_no_cudnn_sdp"] = _timed(decode)
                finally:
                    torch.backends.cuda.enable_cudnn_sdp(was)
            del runner
    return out


def _end_to_end(models: dict[str, str], dtype: str = "fp32", ray: bool = False, device: str = "cuda") -> dict[str, Any]:
    """AR, SD and SSD with target and draft on the one GPU: at T = 0 SD's and
    SSD's tokens equal AR's (fp32: must; bf16: near ties of the logits may
    part them, so it is reported); at T = 0.8 with a seed AR repeats itself
    and every mode completes; tokens/s per mode (after a warm-up call). In
    process, also AR without CUDA graphs (same tokens). ``ray``: through the
    Ray engine, each worker actor on half the GPU (the NCCL data plane must
    form). (``device="cpu"`` is the dry run the tests make of this code.)"""
    from saguaro_ray import EngineConfig
    from saguaro_ray.config import SpeculationConfig

    prompts = PROMPTS + [LONG_PROMPT]
    out: dict[str, Any] = {}
    greedy: dict[str, list[list[int]]] = {}
    sampled: dict[str, list[list[int]]] = {}
    runs = [("ar", True), ("sd", True), ("ssd", True)] + ([] if ray or device != "cuda" else [("ar", False)])
    for mode, graphs in runs:
        label = mode if graphs else f"{mode}_eager"
        spec = SpeculationConfig(mode=mode, k=4, budget=8)
        config = EngineConfig(
            target=models["target"], draft=models["draft"], spec=spec, device=device, dtype=dtype,
            gpus_per_worker=0.5, address="local", cuda_graphs=graphs,
        )
        engine, close = _engine(config, ray)
        try:
            engine.generate(PROMPTS[:1], GREEDY)  # warm-up (CUDA context, kernels, graph captures)
            t0 = time.perf_counter()
            results = engine.generate(prompts, GREEDY)
            seconds = time.perf_counter() - t0
            greedy[label] = [r.token_ids for r in results]
            out[f"{label}_tokens_per_s"] = round(sum(len(t) for t in greedy[label]) / seconds, 1)
            sampled[label] = [r.token_ids for r in engine.generate(prompts, SAMPLED)]
            if mode == "ar" and graphs:
                again = [r.token_ids for r in engine.generate(prompts, SAMPLED)]
                out["seeded_ar_repeats"] = again == sampled[label]
            if not ray:
                errors = _graph_errors(*(w.logic.runner for w in engine.workers.values()))
                if errors:
                    out[f"{label}_graph_errors"] = errors
            if ray:
                metrics = engine.metrics()
                out[f"{mode}_data_plane"] = {k: metrics.get(k) for k in ("data_plane_generation", "data_plane_backend", "data_plane_error")}
        finally:
            close()
    for mode in ("sd", "ssd"):
        out[f"{mode}_equals_ar"] = greedy[mode] == greedy["ar"]
        out[f"{mode}_first_divergence"] = _first_divergence(greedy[mode], greedy["ar"])
        out[f"seeded_{mode}_equals_ar"] = sampled[mode] == sampled["ar"]  # informational: the rule may differ by strategy
    out["completed_sampled"] = all(len(t) == SAMPLED.max_tokens for ts in sampled.values() for t in ts)
    checks = [out["completed_sampled"], out.get("seeded_ar_repeats", True)]
    if "ar_eager" in greedy:
        out["graphs_equal_eager"] = greedy["ar_eager"] == greedy["ar"]
        checks.append(out["graphs_equal_eager"] or dtype != "fp32")
    if dtype == "fp32":
        checks += [out["sd_equals_ar"], out["ssd_equals_ar"]]
    checks += [not any(k.endswith("_graph_errors") for k in out)]
    if ray:
        checks += [(out[f"{m}_data_plane"].get("data_plane_generation") or 0) >= 1 for m in ("sd", "ssd")]
    out["ok"] = all(checks)
    return out


def _engine(config: Any, ray: bool) -> tuple[Any, Callable[[], None]]:
    if ray:
        from saguaro_ray import Engine

        handle = Engine.launch(config)
        return handle, handle.shutdown
    from saguaro_ray.engine import LocalEngine

    local = LocalEngine(config)
    return local, local.close


def _first_divergence(got: list[list[int]], want: list[list[int]]) -> list[int | None]:
    """Per prompt: the first index where the two token lists differ (None: equal)."""
    out: list[int | None] = []
    for g, w in zip(got, want):
        out.append(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None if len(g) == len(w) else min(len(g), len(w))))
    return out


def _real_size_models(root: Path) -> dict[str, Any]:
    """Random-weight bf16 checkpoints of the Qwen2.5-Coder pair's shapes
    (a step costs the same whatever the weights), opened without a tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from saguaro_ray.workers.checkpoint import open_checkpoint

    out = {}
    for role, shape in CODER_SHAPES.items():
        # initialised on the CPU: the CUDA generator stays out of it (and out of
        # any state a failed graph capture may have left it in)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, **CODER_COMMON)).to(torch.bfloat16)
        model.save_pretrained(root / role)
        del model
        out[role] = open_checkpoint(root / role, require_tokenizer=False)
    return out


def _runner(ckpt: Any, graphs: bool = True) -> Any:
    from saguaro_ray.workers.runner import ModelRunner

    return ModelRunner(ckpt, device="cuda", dtype="bf16", cuda_graphs=graphs, max_kv_tokens=32768)


def step_costs(models: dict[str, Any], context: int = 512, k: int = 8) -> dict[str, Any]:
    """Median ms per step at the pair's sizes, bf16, eager and graphed: decode
    and (K+1) verify at batch 1 and 8, one-token tree steps of 1-16 branches."""
    import torch

    out: dict[str, Any] = {}
    for role, ckpt in models.items():
        costs: dict[str, float] = {}
        for graphs in (False, True):
            runner = _runner(ckpt, graphs)
            tag = "graphed" if graphs else "eager"
            for batch in (1, 8):
                seqs = list(range(batch))
                for s in seqs:
                    runner.add_sequence(s)
                    runner.forward([s], [[(7 * i + s) % 1000 for i in range(context)]])
                for n in (1, k + 1):
                    def step(n: int = n, seqs: list[int] = seqs) -> None:
                        runner.forward(seqs, [[5] * n] * len(seqs), num_logits=[n] * len(seqs))
                        for s in seqs:
                            runner.truncate(s, context)

                    costs[f"{tag}_b{batch}_q{n}"] = _timed(step)
                for s in seqs:
                    runner.free_sequence(s)
            runner.add_sequence(0)
            runner.forward([0], [[(7 * i) % 1000 for i in range(context)]])
            for branches in (1, 2, 4, 8, 16):
                def tree(branches: int = branches) -> None:
                    t = runner.tree_start([0] * branches, [context - (i % 4) for i in range(branches)], depth=k)
                    runner.tree_forward(t, [[1]] * branches)

                costs[f"{tag}_tree_step_{branches}"] = _timed(tree)
            if graphs:
                costs["graph_errors"] = _graph_errors(runner)  # type: ignore[assignment]
            del runner
            torch.cuda.empty_cache()
        costs["graph_speedup_decode_b1"] = round(costs["eager_b1_q1"] / costs["graphed_b1_q1"], 2)
        costs["graph_speedup_verify_b1"] = round(costs[f"eager_b1_q{k + 1}"] / costs[f"graphed_b1_q{k + 1}"], 2)
        costs["graph_speedup_tree_8"] = round(costs["eager_tree_step_8"] / costs["graphed_tree_step_8"], 2)
        out[role] = costs
    return out


def ssd_overlap(models: dict[str, Any], context: int = 512, k: int = 4, branches: int = 8) -> dict[str, Any]:
    """The target's (K+1)-token verify and the draft's build (K tree steps of
    ``branches`` branches, graphed), each alone, then both issued at once on
    two CUDA streams of one GPU — the SSD overlap when target and draft share
    a device (on two devices nothing is shared). ``build_hidden``: the share
    of the build that ran under the verify: (verify + build - both) / build."""
    import torch

    target, draft = _runner(models["target"]), _runner(models["draft"])
    for r in (target, draft):
        r.add_sequence(0)
        r.forward([0], [[(3 * i) % 1000 for i in range(context)]])

    def verify() -> None:
        target.forward([0], [[5] * (k + 1)], num_logits=[k + 1])
        target.truncate(0, context)

    def build() -> None:
        t = draft.tree_start([0] * branches, [context - (i % (k + 1)) for i in range(branches)], depth=k)
        for _ in range(k):
            draft.tree_forward(t, [[1]] * branches)

    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def on(stream: Any, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(stream):
                fn()

        return run

    def both() -> None:  # launches are asynchronous: the two streams' work runs side by side
        on(streams[0], verify)()
        on(streams[1], build)()

    alone_v, alone_b = _timed(on(streams[0], verify)), _timed(on(streams[1], build))
    together = _timed(both)
    hidden = (alone_v + alone_b - together) / alone_b if alone_b > 0 else 0.0
    return {"verify_ms": alone_v, "build_ms": alone_b, "both_ms": together, "build_hidden": round(hidden, 3), "k": k, "branches": branches}


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
        reference = [r.token_ids for r in ref.generate(PROMPTS, GREEDY)]
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
            out[f"{mode}_tp2_equals_tp1"] = [r.token_ids for r in handle.generate(PROMPTS, GREEDY)] == reference
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

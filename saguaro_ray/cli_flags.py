"""The flags ``saguaro-ray generate`` and the generate job share, and what they become.

One definition of each flag group (sampling, speculation, engine) and of its
reading into the config it sets, so a flag means the same in both; and the
one way a command ends on a user error: one line on stderr, exit status 2,
never a traceback (anything else is a bug and keeps its traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Callable

from saguaro_ray.errors import SaguaroError
from saguaro_ray.models.spec import QUANT_SCHEMES, SELF_PREFIX

if TYPE_CHECKING:
    from saguaro_ray.config import SamplingParams, SpeculationConfig

EXIT_USAGE = 2
MODEL_FORMS = "a directory, zoo:<preset>/<role>, real:<name> (see `saguaro-ray models list`) or hf:<org>/<name>"
SELF_FORMS = (
    f"or {' / '.join(SELF_PREFIX + s for s in QUANT_SCHEMES)} (the target's own weights, quantised at load), "
    f"or {' / '.join(s + ':SPEC' for s in QUANT_SCHEMES)} (any of the forms above, quantised at load)"
)


def add_sampling_args(group: argparse._ActionsContainer) -> None:
    """The sampling flags, shared by ``generate`` and the generate job."""
    from saguaro_ray.config import LOGPROBS_MODES

    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0, help="sample i of a prompt uses seed+i (default 0)")
    group.add_argument("--n", type=int, default=1, help="independent samples per prompt")
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]: subtracted once from every token already generated")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]: subtracted per occurrence in the generated tokens")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="in (0, 10], 1 = off: logits of tokens in the prompt or output divided by it (multiplied when negative)")
    group.add_argument("--logit-bias", type=json_object, default={}, metavar="JSON", help='added to the logits of token ids: \'{"50256": -100}\' (biases in [-100, 100])')
    group.add_argument("--logprobs", type=int, default=None, help="the target's logprob of each token and of its N likeliest alternatives (0: the token's alone)")
    group.add_argument("--logprobs-mode", default="raw", choices=LOGPROBS_MODES, help="raw: the model's log-softmax; processed: the law sampled from")
    group.add_argument(
        "--response-format", type=json_object, default=None,
        help='structured output, as OpenAI\'s response_format: \'{"type": "json_object"}\' or \'{"type": "json_schema", "json_schema": {"schema": {...}}}\'',
    )


SAMPLING_FLAGS = (
    "max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "logprobs_mode", "response_format",
)  # SamplingParams fields, one flag each


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a flag's value as a JSON object (its contents are the
    config's to check), else argparse's one-line usage error naming the flag."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def sampling_from_args(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> "SamplingParams":
    """The sampling flags as a validated :class:`SamplingParams`; ``overrides``
    (e.g. a prompt file row's own fields) take precedence."""
    from saguaro_ray.config import SamplingParams

    return SamplingParams(**({f: getattr(args, f) for f in SAMPLING_FLAGS} | (overrides or {})))


def run_command(prog: str, command: "Callable[[], int]") -> int:
    """Run a command's body: a user error (any :class:`SaguaroError`) prints one
    line on stderr and exits with status 2 — never a traceback; Ctrl-C exits 130."""
    try:
        return command()
    except SaguaroError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _mode_list(text: str) -> tuple[str, ...]:
    """``--allow ar,sd,ssd`` as a tuple (checked by :class:`SpeculationConfig`)."""
    return tuple(m.strip() for m in text.split(",") if m.strip())


def add_speculation_args(group: argparse._ActionsContainer) -> None:
    """The speculation flags read by :func:`speculation_from_args`."""
    from saguaro_ray.config import STRATEGY_MODES

    group.add_argument("--mode", default="auto", choices=STRATEGY_MODES, help="strategy: auto (the engine picks K, SD or SSD per sequence and round) or a fixed mode")
    group.add_argument("--allow", type=_mode_list, default=(), help="comma-separated strategies requests may name (default: --mode alone; for auto, every mode the models run)")
    group.add_argument("--k", type=int, default=4, help="draft tokens per round (sd, ssd)")
    group.add_argument("--max-k", type=int, default=None, help="the largest K auto or a request may use (default 8, or --k with an explicit --fan-out)")
    group.add_argument("--fan-out", default="auto", help="'auto' or K+1 comma-separated counts (ssd)")
    group.add_argument("--budget", type=int, default=8, help="speculations cached per sequence (ssd, auto fan-out)")
    group.add_argument("--backup", default="neural", help="auto | neural | fast (ssd cache misses)")
    group.add_argument("--stage1", default="exact", help="pyramid qualifier rule: exact | assisted | fuzzy")
    group.add_argument("--stage2", default="exact", help="pyramid target rule: exact | fuzzy")
    group.add_argument("--tau-q", type=float, default=0.0, help="fuzzy threshold of stage 1 (lossy when > 0)")
    group.add_argument("--tau-t", type=float, default=0.0, help="fuzzy threshold of stage 2 (lossy when > 0)")
    group.add_argument("--div", default="reverse_kl", help="fuzzy divergence: reverse_kl | kl | js | tv")
    group.add_argument("--lq", type=int, default=4, help="pyramid: qualified tokens per target verification")
    group.add_argument("--ld", type=int, default=2, help="pyramid: draft tokens per qualifier check")
    group.add_argument("--allow-lossy", action="store_true", help="accept fuzzy stages with tau > 0 (not exact)")


def add_draft_vocab_arg(group: argparse._ActionsContainer) -> None:
    """``--draft-vocab N`` (EngineConfig.draft_vocab), wherever ``--draft`` is."""
    group.add_argument(
        "--draft-vocab", type=int, default=None, metavar="N",
        help="the drafts' LM head covers only N token ids (the special ones and the lowest others; exact: q = 0 elsewhere)",
    )


def add_engine_args(group: argparse._ActionsContainer) -> None:
    """The engine flags read by :func:`engine_options_from_args`, shared by ``generate`` and the generate job."""
    group.add_argument("--device", default="cpu")
    group.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
    group.add_argument("--attention-backend", default=None, help="auto | torch | flash_attn")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="on CUDA, run every step eagerly (default: decode and verify replay CUDA graphs)")
    group.add_argument("--num-drafts", type=int, default=1, help="SSD: drafts that split the outcome set (each its own actor, or thread in process)")
    add_draft_vocab_arg(group)
    group.add_argument("--max-batch-size", type=int, default=64)
    group.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 1 per Ray actor; in process, the CPUs split between the workers)")
    group.add_argument("--address", default=None, help="Ray cluster address (default: join a running one — a job's own — else start locally)")
    group.add_argument("--worker-cpus", type=float, default=0.5, help="logical CPUs Ray reserves per worker actor")
    group.add_argument("--no-pin-cores", dest="pin_cores", action="store_false", help="on CPU, leave Ray workers' threads to the scheduler (default: each claims cores of its own)")
    group.add_argument("--target-tp", type=int, default=1, help="shard the target over this many rank actors (one GPU each on CUDA; tensor parallelism)")


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`EngineConfig` fields the :func:`add_engine_args` flags set."""
    return dict(
        num_drafts=args.num_drafts,
        draft_vocab=args.draft_vocab,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        max_batch_size=args.max_batch_size,
        threads_per_worker=args.threads,
        address=args.address,
        worker_cpus=args.worker_cpus,
        pin_cores=args.pin_cores,
        target_tp=args.target_tp,
    )


def speculation_from_args(args: argparse.Namespace) -> "SpeculationConfig":
    """The speculation flags as a validated :class:`SpeculationConfig`."""
    from saguaro_ray.algorithms.fanout import parse_fanout
    from saguaro_ray.config import SpeculationConfig

    fanout = parse_fanout(args.fan_out, args.max_k or args.k)  # one count per K up to the largest
    return SpeculationConfig(
        mode=args.mode,
        allow=args.allow,
        k=args.k,
        max_k=args.max_k,
        fanout=fanout if fanout == "auto" else tuple(fanout),
        budget=args.budget,
        backup=args.backup,
        stage1=args.stage1,
        stage2=args.stage2,
        tau_q=args.tau_q,
        tau_t=args.tau_t,
        div=args.div,
        lq=args.lq,
        ld=args.ld,
        allow_lossy=args.allow_lossy,
    )

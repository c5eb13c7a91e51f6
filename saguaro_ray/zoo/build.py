"""Build a zoo family on disk: tokenizer, target, distilled qualifier and draft.

Layout of a family directory ``DIR``::

    DIR/zoo.json            summary (what ``build_family`` returns)
    DIR/target/             Hugging Face checkpoint (config.json, model.safetensors,
    DIR/qualifier/          generation_config.json, tokenizer files): loadable by
    DIR/draft/              AutoModelForCausalLM / AutoTokenizer.from_pretrained

A build runs in a temporary sibling directory that is renamed into place only
when complete, so an interrupted build never looks finished; an ``fcntl``
lock next to ``DIR`` makes concurrent callers (processes, Ray actors) wait
for the one build and then reuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from saguaro_ray.errors import ConfigError
from saguaro_ray.zoo import corpus
from saguaro_ray.zoo.model import TrainLlama
from saguaro_ray.zoo.presets import ROLES, Preset, get_preset
from saguaro_ray.zoo.tokenizer import EOS_TOKEN, hf_tokenizer, train_tokenizer
from saguaro_ray.zoo.train import distill, evaluate, round_weights, token_stream, train_lm

logger = logging.getLogger(__name__)

# Bump when the build procedure changes in a way that changes the weights.
BUILD_VERSION = 1
SUMMARY_FILE = "zoo.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")
_SAVE_DTYPE = torch.bfloat16


def zoo_root() -> Path:
    """``$SAGUARO_ZOO_DIR`` if set, else ``~/.cache/saguaro-ray/zoo``."""
    env = os.environ.get("SAGUARO_ZOO_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saguaro-ray" / "zoo"


def _read_complete(dest: Path, preset: Preset) -> dict[str, Any] | None:
    """The summary of a complete, current build at ``dest``, else None."""
    try:
        summary = json.loads((dest / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(summary, dict)
        or summary.get("preset") != preset.name
        or summary.get("version") != BUILD_VERSION
        or summary.get("preset_hash") != preset.hash()
    ):
        return None
    for role in ROLES:
        if not all((dest / role / f).is_file() for f in _REQUIRED_FILES):
            return None
    return summary


class _Reporter:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        logger.info("%s", msg)
        if self.enabled:
            print(f"[zoo] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _build_threads(preset: Preset) -> int:
    env = os.environ.get("SAGUARO_ZOO_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ConfigError(f"SAGUARO_ZOO_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ConfigError(f"SAGUARO_ZOO_THREADS must be a positive integer, got {env!r}")
        return n
    return preset.threads


def build_family(preset: str, out: str | os.PathLike | None = None, progress: bool = True) -> dict[str, Any]:
    """Build the ``preset`` family into ``out`` (default ``zoo_root()/<preset>``).

    Returns the summary dict (also written to ``DIR/zoo.json``). Returns at
    once when a complete build of the current preset definition is already
    there; concurrent callers wait on a file lock and then reuse the build.
    """
    p = get_preset(preset)
    dest = (Path(out).expanduser() if out is not None else zoo_root() / p.name).absolute()
    summary = _read_complete(dest, p)
    if summary is not None:
        return summary
    say = _Reporter(progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building {dest} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            summary = _read_complete(dest, p)
            if summary is not None:
                return summary
            if dest.exists() and not (dest / SUMMARY_FILE).exists() and any(dest.iterdir()):
                raise ConfigError(f"{dest} exists and is not a zoo family directory; pass an empty or new directory")
            # Leftovers of interrupted builds (we hold the lock: nobody uses them).
            for stale in dest.parent.glob(f".{dest.name}.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            try:
                say(f"building zoo family {p.name!r} into {dest} ({p.description})")
                summary = _build_into(tmp, p, say, progress)
                old = None
                if dest.exists():
                    old = dest.parent / f".{dest.name}.building-old-{os.getpid()}"
                    os.rename(dest, old)
                os.rename(tmp, dest)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            say(f"done in {summary['build_seconds']:.0f} s: {dest}")
            return summary
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _new_model(p: Preset, role: str, seed: int) -> TrainLlama:
    torch.manual_seed(seed)
    return TrainLlama(p.shape(role), p.vocab_size, max_len=p.max_position_embeddings)


def _build_into(tmp: Path, p: Preset, say: _Reporter, progress: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    threads = _build_threads(p)
    # Seeds are set freely below; the caller's global RNG state is restored after.
    with _torch_threads(threads), torch.random.fork_rng(devices=[]):
        # Corpus and tokenizer.
        t0 = time.perf_counter()
        train_files = corpus.corpus_files(
            heldout=False, include_tests=p.corpus.include_tests, max_bytes=p.corpus.max_bytes
        )
        heldout_files = corpus.corpus_files(heldout=True)
        train_texts = [f.text for f in train_files]
        say(f"training a {p.vocab_size}-token byte-level BPE tokenizer on {len(train_files)} files")
        tok = train_tokenizer(train_texts, p.vocab_size)
        eos_id = tok.token_to_id(EOS_TOKEN)
        stream = token_stream([e.ids for e in tok.encode_batch(train_texts)], eos_id)
        heldout = token_stream([e.ids for e in tok.encode_batch([f.text for f in heldout_files])], eos_id)
        say(f"corpus: {stream.numel():,} train tokens, {heldout.numel():,} held-out tokens")
        t_tok = time.perf_counter() - t0

        # Target: next-token cross-entropy.
        t0 = time.perf_counter()
        target = _new_model(p, "target", seed=1)
        say(f"training target ({target.num_parameters() / 1e6:.2f} M params, {p.target_train.steps} steps)")
        w = p.target_train.seq_len + 1
        monitor = heldout[-4 * w :].view(4, w)  # the end of the held-out stream: not the eval windows
        target_train_loss = train_lm(
            target,
            stream,
            p.target_train,
            progress=progress,
            desc="zoo target",
            monitor_batch=monitor if progress else None,
        )
        round_weights(target, _SAVE_DTYPE)
        seconds = {"target": time.perf_counter() - t0}

        # Qualifier and draft: distilled from the target together.
        t0 = time.perf_counter()
        students = {"qualifier": _new_model(p, "qualifier", seed=2), "draft": _new_model(p, "draft", seed=3)}
        say(
            "distilling qualifier ({:.2f} M) and draft ({:.2f} M) from the target ({} steps)".format(
                students["qualifier"].num_parameters() / 1e6,
                students["draft"].num_parameters() / 1e6,
                p.distill.steps,
            )
        )
        w = p.distill.seq_len + 1
        final_kl = distill(
            students,
            target,
            stream,
            p.distill,
            kl_weight=p.kl_weight,
            progress=progress,
            desc="zoo distill",
            monitor_batch=heldout[-4 * w :].view(4, w) if progress else None,
        )
        for m in students.values():
            round_weights(m, _SAVE_DTYPE)
        seconds["qualifier"] = seconds["draft"] = time.perf_counter() - t0

        # Held-out evaluation.
        t0 = time.perf_counter()
        models = {"target": target, **students}
        say("evaluating on the held-out slice")
        metrics = evaluate(models, heldout, p.distill.seq_len, p.eval_windows)
        t_eval = time.perf_counter() - t0

        # Save as Hugging Face checkpoints and check that transformers agrees.
        t0 = time.perf_counter()
        hf_tok = hf_tokenizer(tok, model_max_length=p.max_position_embeddings)
        with _quiet_transformers():
            for role, model in models.items():
                _save_checkpoint(model, p, tmp / role, eos_id)
                hf_tok.save_pretrained(tmp / role)
                _make_tokenizer_config_portable(tmp / role)
            _check_hf_parity(tmp, models, heldout)
        t_save = time.perf_counter() - t0

    train_tokens = {
        "target": p.target_train.steps * p.target_train.batch_size * p.target_train.seq_len,
        "distill": p.distill.steps * p.distill.batch_size * p.distill.seq_len,
    }
    summary: dict[str, Any] = {
        "preset": p.name,
        "description": p.description,
        "version": BUILD_VERSION,
        "preset_hash": p.hash(),
        "fingerprint": _fingerprint(p),
        "corpus": {
            "source": str(corpus.stdlib_root()),
            "python": platform.python_version(),
            "fingerprint": corpus.corpus_fingerprint(),
            "include_tests": p.corpus.include_tests,
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(stream.numel()),
            "heldout_tokens": int(heldout.numel()),
            "eval_tokens": int(metrics["_tokens"]["count"]),
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": p.vocab_size, "eos_token": EOS_TOKEN, "eos_id": eos_id},
        "models": {},
        "build": {
            "threads": threads,
            "torch": torch.__version__,
            "seconds": {
                "tokenizer": round(t_tok, 1),
                "target": round(seconds["target"], 1),
                "distill": round(seconds["draft"], 1),
                "eval": round(t_eval, 1),
                "save": round(t_save, 1),
            },
        },
    }
    for role in ROLES:
        m, s = models[role], p.shape(role)
        entry: dict[str, Any] = {
            "params": m.num_parameters(),
            "layers": s.num_layers,
            "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size,
            "heads": s.num_heads,
            "kv_heads": s.num_kv_heads,
            "heldout_loss": round(metrics[role]["heldout_loss"], 4),
        }
        if role == "target":
            entry["train_tokens_seen"] = train_tokens["target"]
            entry["final_train_loss"] = round(target_train_loss, 4)
        else:
            entry["greedy_agreement"] = round(metrics[role]["greedy_agreement"], 4)
            entry["train_tokens_seen"] = train_tokens["distill"]
            entry["final_train_kl"] = round(final_kl[role], 4)
        entry["build_seconds"] = round(seconds[role], 1)
        summary["models"][role] = entry
    summary["build_seconds"] = round(time.perf_counter() - t_start, 1)
    (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fingerprint(p: Preset) -> str:
    h = hashlib.sha256(f"{BUILD_VERSION}:{p.hash()}:{corpus.corpus_fingerprint()}".encode())
    return h.hexdigest()[:16]


def _save_checkpoint(model: TrainLlama, p: Preset, out: Path, eos_id: int) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    s = model.shape
    cfg = LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta,
        hidden_act="silu",
        tie_word_embeddings=s.tie_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    hf = LlamaForCausalLM(cfg)
    state = {k: v.to(_SAVE_DTYPE) for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not (s.tie_embeddings and k == "lm_head.weight")]:
        raise RuntimeError(f"zoo: parameter names differ from HF Llama: missing={missing} unexpected={unexpected}")
    hf = hf.to(_SAVE_DTYPE)
    hf.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    # Also write the transformers-4 spellings of dtype and RoPE base, for
    # readers (our model runner, older transformers) that look for them.
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data.setdefault("torch_dtype", "bfloat16")
    data.setdefault("rope_theta", s.rope_theta)
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _quiet_transformers():
    """No "Loading weights" / "Writing model shards" bars while saving and checking."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _make_tokenizer_config_portable(role_dir: Path) -> None:
    """Let transformers 4.x load the tokenizer too (5.x writes 5.x-only names).

    Adds the 4.x spellings (``PreTrainedTokenizerFast``,
    ``additional_special_tokens``, the chat template inline); 5.x reads both.
    """
    from saguaro_ray.zoo.tokenizer import CHAT_TEMPLATE, ROLE_TOKENS

    path = role_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data.setdefault("additional_special_tokens", list(ROLE_TOKENS))
    data.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _check_hf_parity(family: Path, models: dict[str, TrainLlama], heldout: torch.Tensor) -> None:
    """Reload every saved checkpoint with transformers; its logits must match ours."""
    from transformers import AutoModelForCausalLM

    ids = heldout[:128].view(2, 64)
    for role, model in models.items():
        hf = AutoModelForCausalLM.from_pretrained(family / role, dtype=torch.float32)
        hf.eval()
        ref = hf(ids).logits
        ours = model(ids).float()
        err = float((ref - ours).abs().max())
        # float32 implementations differ by ~1e-5 relative; a real mismatch
        # (layout, RoPE, norm) is O(1).
        if not err <= 1e-3 * max(1.0, float(ref.abs().max())):
            raise RuntimeError(
                f"zoo: saved {role} checkpoint does not reproduce the trained model (max |dlogit| {err:g})"
            )


def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of a family's ``zoo.json`` numbers."""
    c = summary.get("corpus", {})
    vocab = summary.get("tokenizer", {}).get("vocab_size", "?")
    lines = [
        (
            f"zoo family {summary.get('preset', '?')!r} (build v{summary.get('version', '?')}, "
            f"fingerprint {summary.get('fingerprint', '?')})"
        ),
        (
            f"corpus: {c.get('source', '?')} - {c.get('train_files', '?')} train files / "
            f"{c.get('train_tokens', 0):,} tokens; {c.get('heldout_files', '?')} held-out files / "
            f"{c.get('heldout_tokens', 0):,} tokens; vocab {vocab}"
        ),
        "",
        (
            f"{'model':<10} {'params':>9} {'layers':>6} {'hidden':>6} {'heads':>6} {'held-out loss':>13} "
            f"{'agreement':>9} {'build s':>8}"
        ),
    ]
    for role in ROLES:
        m = summary.get("models", {}).get(role)
        if m is None:
            continue
        agree = m.get("greedy_agreement")
        heads = f"{m.get('heads', '?')}/{m.get('kv_heads', '?')}"
        lines.append(
            f"{role:<10} {m['params'] / 1e6:>8.2f}M {m['layers']:>6} {m['hidden_size']:>6} {heads:>6} "
            f"{m['heldout_loss']:>13.3f} {'-' if agree is None else f'{agree:.3f}':>9} "
            f"{m.get('build_seconds', float('nan')):>8.0f}"
        )
    lines.append("")
    lines.append(
        f"agreement = fraction of held-out positions where the model's argmax equals the target's; "
        f"qualifier and draft are distilled together (shared build s); "
        f"total build {summary.get('build_seconds', float('nan')):.0f} s"
    )
    return "\n".join(lines)


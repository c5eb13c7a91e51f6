"""What building a zoo family does: corpus and tokenizer, the target trained by
next-token cross-entropy, the qualifier and draft distilled from it together,
held-out evaluation, Hugging Face checkpoints, and the summary of it all.

Everything is seeded and step-counted (never timed), so a preset always gives
the same weights; :mod:`.build` decides when a build is needed and puts it in
place.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from saguaro_ray.errors import ConfigError
from saguaro_ray.torch_threads import torch_threads
from saguaro_ray.zoo import corpus
from saguaro_ray.zoo.hf_export import SAVE_DTYPE, check_hf_parity, make_tokenizer_config_portable, quiet_transformers, save_checkpoint
from saguaro_ray.zoo.model import TrainLlama
from saguaro_ray.zoo.presets import ROLES, Preset
from saguaro_ray.zoo.tokenizer import EOS_TOKEN, hf_tokenizer, train_tokenizer
from saguaro_ray.zoo.train import distill, evaluate, round_weights, token_stream, train_lm

# Bump when the build procedure changes in a way that changes the weights.
BUILD_VERSION = 1


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


def _new_model(p: Preset, role: str, seed: int) -> TrainLlama:
    torch.manual_seed(seed)
    return TrainLlama(p.shape(role), p.vocab_size, max_len=p.max_position_embeddings)


def build_into(tmp: Path, p: Preset, say: Callable[[str], None], progress: bool) -> dict[str, Any]:
    """Build preset ``p``'s family into the empty directory ``tmp``; returns its summary
    (what ``DIR/zoo.json`` holds). ``say`` reports each stage."""
    t_start = time.perf_counter()
    threads = _build_threads(p)
    # Seeds are set freely below; the caller's global RNG state is restored after.
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
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
        round_weights(target, SAVE_DTYPE)
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
            round_weights(m, SAVE_DTYPE)
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
        with quiet_transformers():
            for role, model in models.items():
                save_checkpoint(model, p, tmp / role, eos_id)
                hf_tok.save_pretrained(tmp / role)
                make_tokenizer_config_portable(tmp / role)
            check_hf_parity(tmp, models, heldout)
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
    return summary


def _fingerprint(p: Preset) -> str:
    h = hashlib.sha256(f"{BUILD_VERSION}:{p.hash()}:{corpus.corpus_fingerprint()}".encode())
    return h.hexdigest()[:16]


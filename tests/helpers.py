"""Shared test helpers: tiny random Hugging Face checkpoints.

Usage from any test module (``tests/`` is on ``sys.path`` under pytest's
default import mode)::

    from helpers import save_tiny_checkpoint, load_hf_model, hf_logits

    path = save_tiny_checkpoint(tmp_path, "qwen3")            # a directory
    runner = ModelRunner(path)                               # loads (with tokenizer)
    ref = hf_logits(load_hf_model(path), [5, 6, 7])          # [3, V] fp32

Everything is deterministic: the same ``(arch, seed, overrides)`` always gives
the same weights, and the global torch RNG is left untouched.
"""

from __future__ import annotations

import os
import signal
import string
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

# Tests run on 2 shared cores; with the default thread count tiny matmuls can
# stall for milliseconds each on contended cores, so test modules run in one
# thread (conftest's ``one_thread`` fixture; a block: torch_threads(1)).
from saguaro_ray.torch_threads import torch_threads  # noqa: F401  (used by the test modules)

# Architecture presets: (transformers config class name, config kwargs).
# The common base is: vocab 128, hidden 32, 2 layers, 4 query heads over 2 KV
# heads (GQA), context 128; each preset adds what makes the family distinct.
ARCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # Llama-3 RoPE scaling with a small original context, so the scaled
    # frequencies matter within a few tokens; head_dim 16 gives frequencies in
    # all three regimes (kept, divided by `factor`, blended).
    "llama3": (
        "LlamaConfig",
        {
            "hidden_size": 64,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v biases (randomised below)
    "qwen3": ("Qwen3Config", {"head_dim": 24}),  # q/k RMSNorm, head_dim != hidden/heads
}

_BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}

# tokenizer vocabulary: specials, then single printable characters
_SPECIALS = ("<unk>", "<s>", "</s>")
_CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def save_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Build a tiny random model of ``arch`` and save it as an HF checkpoint.

    ``arch`` is one of :data:`ARCHES` (``llama``, ``llama3``, ``mistral``,
    ``qwen2``, ``qwen3``); ``overrides`` are extra/replacement config kwargs
    (e.g. ``tie_word_embeddings=True``, ``attention_bias=True``,
    ``sliding_window=4``, ``max_position_embeddings=32``). Weights are
    re-initialised from ``seed`` at a scale where attention is far from
    uniform and logits are O(1): matrices ~ N(0, 1/fan_in), embeddings
    ~ N(0, 1), every bias ~ N(0, 0.1^2) (so biases are nonzero) and every
    RMSNorm weight ~ 1 + N(0, 0.1^2).

    ``tokenizer=True`` also writes a character-level ``tokenizer.json``
    (ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, then printable ASCII; needs
    ``vocab_size >= 99`` to cover all characters). ``max_shard_size`` (e.g.
    ``"20KB"``) saves shards plus ``model.safetensors.index.json``.

    Returns the checkpoint directory: a fresh sub-directory of ``tmp_path``
    (named after ``arch``), so several checkpoints can share one ``tmp_path``.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHES)}")
    cls_name, preset = ARCHES[arch]
    kwargs = {**_BASE, **preset, **overrides}
    config = getattr(transformers, cls_name)(**kwargs)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                elif "embed_tokens" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)

    root = Path(tmp_path)
    out = root / arch
    i = 1
    while out.exists():
        i += 1
        out = root / f"{arch}-{i}"
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    if tokenizer:
        _save_char_tokenizer(out, int(kwargs["vocab_size"]))
    return out


def _save_char_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in (*_SPECIALS, *_CHARS):
        if len(vocab) < vocab_size:
            vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def load_hf_model(path: str | Path, **config_overrides: Any) -> torch.nn.Module:
    """The checkpoint as a ``transformers`` fp32 model (eager attention, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **config_overrides
    ).eval()


def hf_logits(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 logits ``[len(tokens), V]`` of ``model`` run on one sequence from scratch."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    with torch.no_grad():
        return model(ids).logits[0].float()


def perturbed_checkpoint(src: Path, dst: Path, scale: float, seed: int) -> Path:
    """A copy of checkpoint ``src`` with Gaussian noise (``scale`` × each
    tensor's std) on every weight: a draft that partly agrees with the target."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    noisy = {
        name: (w + scale * w.std() * torch.randn(w.shape, generator=gen)).contiguous() if w.numel() > 1 else w
        for name, w in weights.items()
    }
    save_file(noisy, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def coordinator_pid(handle: Any, timeout_s: float = 60.0) -> int:
    """The process of a Ray engine's coordinator actor."""
    import ray

    return ray.get(handle.coordinator.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout_s)


def engine_pids(handle: Any) -> set[int]:
    """A Ray engine's processes: its coordinator and its workers."""
    return {coordinator_pid(handle), *(info["pid"] for info in handle.worker_info().values())}


def kill_coordinator(handle: Any) -> int:
    """SIGKILL a Ray engine's coordinator (Ray restarts it within its max_restarts); returns its pid."""
    pid = coordinator_pid(handle)
    os.kill(pid, signal.SIGKILL)
    return pid


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn(*args)`` on a thread; its result or error lands in the dict ("value" / "error")."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 — handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def rounds_run(handle: Any) -> int:
    """Rounds the coordinator has run (-1 while it is restarting: admin calls do not wait)."""
    from saguaro_ray.errors import WorkerGone

    try:
        return len(handle.timeline())
    except WorkerGone:
        return -1


def wait_until_progress(handle: Any, rounds: int = 8, timeout_s: float = 60) -> None:
    """Until the coordinator has run ``rounds`` rounds since now (a request is mid-flight)."""
    start = max(0, rounds_run(handle))
    deadline = time.monotonic() + timeout_s
    while rounds_run(handle) < start + rounds:
        assert time.monotonic() < deadline, "the request made no progress"
        time.sleep(0.05)


def wait_until_back(handle: Any, timeout_s: float = 180) -> None:
    """Until a restarted coordinator has run a round (its timeline starts empty)."""
    deadline = time.monotonic() + timeout_s
    while rounds_run(handle) < 1:
        assert time.monotonic() < deadline, "the coordinator never came back"
        time.sleep(0.05)

"""Write a trained zoo model as an ordinary Hugging Face checkpoint, and prove it.

A family is only useful if every consumer (our model runner, transformers,
older transformers) reads the same model, so the checkpoint is written with
both transformers-5 and transformers-4 spellings and then reloaded with
transformers, whose logits must match the trained model's.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from saguaro_ray.zoo.model import TrainLlama
from saguaro_ray.zoo.presets import Preset
from saguaro_ray.zoo.tokenizer import CHAT_TEMPLATE, ROLE_TOKENS

# Saved weights are bfloat16; training rounds its weights to it first, so the
# saved model is exactly the one evaluated.
SAVE_DTYPE = torch.bfloat16


def save_checkpoint(model: TrainLlama, p: Preset, out: Path, eos_id: int) -> None:
    """``model`` as a Hugging Face Llama checkpoint in ``out`` (config, bf16 weights, generation config)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    s = model.shape
    cfg = LlamaConfig(
        vocab_size=p.vocab_size, max_position_embeddings=p.max_position_embeddings, tie_word_embeddings=s.tie_embeddings,
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, hidden_act="silu", num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
        rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    hf = LlamaForCausalLM(cfg)
    state = {k: v.to(SAVE_DTYPE) for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not (s.tie_embeddings and k == "lm_head.weight")]:
        raise RuntimeError(f"zoo: parameter names differ from HF Llama: missing={missing} unexpected={unexpected}")
    hf = hf.to(SAVE_DTYPE)
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
def quiet_transformers():
    """No "Loading weights" / "Writing model shards" bars while saving and checking."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_tokenizer_config_portable(role_dir: Path) -> None:
    """Let transformers 4.x load the tokenizer too (5.x writes 5.x-only names).

    Adds the 4.x spellings (``PreTrainedTokenizerFast``,
    ``additional_special_tokens``, the chat template inline); 5.x reads both.
    """
    path = role_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data.setdefault("additional_special_tokens", list(ROLE_TOKENS))
    data.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def check_hf_parity(family: Path, models: dict[str, TrainLlama], heldout: torch.Tensor) -> None:
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


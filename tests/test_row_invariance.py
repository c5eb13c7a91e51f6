"""A position's logits have the same bits whatever step computes them.

T = 0 exactness of every speculative mode rests on this: the target's logits
for a position must not depend on whether AR decodes it alone, a (K+1)-token
verification carries it, or other sequences share the batch. On the CPU
torch's attention and oneDNN's linears round a row differently depending on
the rows around it (a bf16 Qwen2.5-Coder gave logits 0.25 apart, fp32 ~2e-5),
so the runner attends each decode/verification row alone and computes a lone
linear row as two (kernels/paged_attention.py, kernels/linear.py). The model
here has a real model's widths (Qwen2.5-0.5B's hidden, heads and MLP), where
those kernels do take different paths, and random weights; the shapes are
what matter, not what the model says.
"""

from __future__ import annotations

import pytest
import torch

from helpers import save_tiny_checkpoint, torch_threads
from saguaro_ray.kernels.linear import packing_available
from saguaro_ray.workers.runner import ModelRunner

PROMPT = 40
STEPS = 14


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("wide"), "qwen2", vocab_size=2048, hidden_size=896,
        intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=2,
        max_position_embeddings=256,
    )
    with torch_threads(1):
        yield path


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_verify_and_batch_give_the_same_bits(wide_model, dtype: str) -> None:
    if not packing_available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN packing not available for {dtype}")
    r = ModelRunner(wide_model, dtype=dtype)
    prompt, cont = _tokens(1, PROMPT), _tokens(2, STEPS)
    r.add_sequence("ar")
    r.forward(["ar"], [prompt])
    decoded = torch.cat([r.forward(["ar"], [[t]]) for t in cont])  # AR: one row at a time

    r.add_sequence("sd")
    r.forward(["sd"], [prompt])
    verified = torch.cat([r.forward(["sd"], [cont[i : i + 5]], all_logits=True) for i in range(0, STEPS, 5)])
    assert torch.equal(verified, decoded)

    # the same positions beside another sequence (a batch of 2, ragged query lengths)
    r.add_sequence("b1")
    r.add_sequence("other")
    r.forward(["b1", "other"], [prompt, _tokens(3, PROMPT + 7)])
    rows = []
    for i in range(0, STEPS, 3):
        chunk = cont[i : i + 3]
        out = r.forward(["b1", "other"], [chunk, _tokens(4 + i, 2)], all_logits=True)
        rows.append(out[: len(chunk)])
    assert torch.equal(torch.cat(rows), decoded)

    # after a rollback (a rejected speculation), re-verified rows equal AR's as well
    r.truncate("sd", PROMPT + 3)
    assert torch.equal(r.forward(["sd"], [cont[3:9]], all_logits=True), decoded[3:9])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_of_eight_verifies_the_bits_it_decodes(wide_model, dtype: str) -> None:
    """Eight sequences verifying 5 tokens each (40 rows a linear call) give the
    logits their decodes give (8 rows). In bf16 only because no call exceeds 32
    rows (``BF16_CALL_ROWS``): one call of 40 rows made 47 of these 80 rows differ
    by a bf16 step, and a seeded T > 0 request's tokens depend on its strategy."""
    if not packing_available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN packing not available for {dtype}")
    r = ModelRunner(wide_model, dtype=dtype)
    batch, steps = 8, 10
    prompts = [_tokens(10 + i, PROMPT + 13 * i) for i in range(batch)]
    cont = [_tokens(30 + i, steps) for i in range(batch)]
    ar, sd = [f"ar{i}" for i in range(batch)], [f"sd{i}" for i in range(batch)]
    for s in ar + sd:
        r.add_sequence(s)
    r.forward(ar, prompts)
    r.forward(sd, prompts)
    decoded = torch.stack([r.forward(ar, [[c[j]] for c in cont]) for j in range(steps)], 1)
    verified = torch.cat([r.forward(sd, [c[j : j + 5] for c in cont], all_logits=True).view(batch, 5, -1) for j in range(0, steps, 5)], 1)
    assert torch.equal(verified, decoded)

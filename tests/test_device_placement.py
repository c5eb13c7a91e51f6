"""Every tensor a hot path makes is made on the device of what it meets.

No GPU runs here, so a CPU test cannot see a CUDA/CPU mix-up directly. It can
see its cause: a factory call (``torch.tensor``, ``torch.arange``, ...) that
names no device and so lands on the *default* device. These tests run the
workers' hot paths — prefill, drafting, verification at T > 0 with mixed
laws and rules, the SSD tree build and its lookup — with the default device
set to ``meta``: the models and their caches stay on the CPU, and any tensor
made without a device becomes a meta tensor that fails the moment it meets
a CPU one (or is read back). On CUDA the same call made a CPU tensor that met
CUDA ones: the crashes of the first GPU review (target.py's proposal tokens,
draft.py's tree tokens) fail here on the old code.
"""

from __future__ import annotations

import pytest
import torch
from helpers import perturbed_checkpoint, save_tiny_checkpoint

from saguaro_ray.algorithms.tensors import tensor_like
from saguaro_ray.config import SamplingParams
from saguaro_ray.engine.round_loop import RoundLoop
from saguaro_ray.engine.sequence import SequenceState
from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels import attention
from saguaro_ray.workers import ssd_protocol
from saguaro_ray.workers.draft import DraftLogic
from saguaro_ray.workers.messages import VerifyItem
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.target import TargetLogic

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

HOT = torch.device("meta")  # the default device while a hot path runs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_placement_models")
    target = save_tiny_checkpoint(root, "llama", seed=3, max_position_embeddings=256)
    return {"target": target, "draft": perturbed_checkpoint(target, root / "draft", 0.1, seed=7)}


def _logic(ckpts):
    return TargetLogic(ModelRunner(str(ckpts["target"]))), DraftLogic(ModelRunner(str(ckpts["draft"])))


def _round(target: TargetLogic, draft: DraftLogic, seqs: list[SequenceState], k: int, rules: list[tuple[str, float]]) -> None:
    """Prefill, draft ``k`` tokens, verify them (each sequence with its rule
    and τ; proposals carry their laws when a lossy fuzzy rule reads them),
    build the next round's tree and look the outcome up — all under ``HOT``."""
    with HOT:
        for w in (target, draft):
            w.prefill([RoundLoop.step(s) for s in seqs])
        for s in seqs:
            s.output_ids.append(s.seq_id + 20)  # the admission round's token
            s.rounds += 1
        steps = [RoundLoop.step(s) for s in seqs]
        proposals = draft.propose(steps, [k] * len(seqs), with_laws=any(tau > 0 for _, tau in rules))
        outcomes = target.verify([VerifyItem(st, p, rule=r, tau=tau) for st, p, (r, tau) in zip(steps, proposals, rules)])
        assert [len(p.tokens) for p in proposals] == [k] * len(seqs)
        items = ssd_protocol.build_items(steps, proposals, [[2] + [1] * k] * len(seqs), [k] * len(seqs), 0, 1, [None] * len(seqs))
        built = draft.build(items, 1)
        assert built["branches"] > 0
        for s, p, o in zip(seqs, proposals, outcomes):
            s.emit(p.tokens[: o.accepted] + [o.next_token], ())
        draft.lookup([(o.seq_id, o.accepted, o.next_token) for o in outcomes], round_id=1)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_a_round_makes_no_tensor_on_the_default_device(ckpts, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=40, seed=5)
    target, draft = _logic(ckpts)
    seqs = [SequenceState(i, [3, 5, 7, 9 + i], params, 0) for i in range(2)]
    _round(target, draft, seqs, 3, [("exact", 0.0), ("exact", 0.0)])


def test_mixed_laws_and_rules_in_one_verification_make_no_tensor_on_the_default_device(ckpts):
    """Per-row temperatures (one law per sequence) and two rules in one batch
    (the drafter-invariant rule and a lossy fuzzy stage's test, with the q
    rows and uniforms it reads): the per-row and per-group index tensors of
    verification."""
    target, draft = _logic(ckpts)
    laws = [SamplingParams(temperature=0.7, top_k=20, max_tokens=40, seed=1), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=2)]
    seqs = [SequenceState(i, [3, 5, 7, 9 + i], laws[i], 0) for i in range(2)]
    _round(target, draft, seqs, 2, [("exact", 0.0), ("fuzzy", 0.3)])


def test_a_runner_step_returns_logits_on_its_own_device(ckpts):
    runner = ModelRunner(str(ckpts["target"]))
    with HOT:
        runner.add_sequence(1)
        runner.add_sequence(2)
        logits = runner.forward([1, 2], [[3, 5, 7], [4, 6]], all_logits=True)
        tree = runner.tree_start([1, 1, 2], [3, 2, 2])
        tree_logits = runner.tree_forward(tree, [[9], [10], [11]])
    assert logits.device == runner.device and tree_logits.device == runner.device
    assert logits.shape[0] == 5 and tree_logits.shape[:2] == (3, 1)


def test_tensor_like_puts_host_values_beside_the_tensor_they_meet():
    ref = torch.zeros(2, dtype=torch.float64)
    with HOT:
        t = tensor_like(ref, [1, 2, 3], dtype=torch.long)
    assert t.device == ref.device and t.dtype == torch.long and t.tolist() == [1, 2, 3]


# --------------------------------------------------------- attention backend
def test_the_backend_follows_device_and_dtype(monkeypatch):
    """flash-attn runs fp16/bf16 only: on CUDA in fp32 ``auto`` takes torch's
    attention without trying flash-attn, and asking for flash-attn in fp32 is
    refused before anything is imported."""

    def no_flash():
        raise AssertionError("flash-attn must not be chosen for fp32")

    monkeypatch.setattr(attention, "FlashAttnBackend", no_flash)
    cuda = torch.device("cuda", 0)
    assert isinstance(attention.select_backend(None, cuda, torch.float32), attention.TorchBackend)
    assert isinstance(attention.select_backend("auto", torch.device("cpu"), torch.bfloat16), attention.TorchBackend)
    with pytest.raises(ConfigError, match="fp16 or bf16"):
        attention.select_backend("flash_attn", cuda, torch.float32)
    with pytest.raises(ConfigError, match="CUDA"):
        attention.select_backend("flash_attn", torch.device("cpu"), torch.bfloat16)

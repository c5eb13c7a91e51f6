"""Tensor parallelism of the target (DESIGN §3, §5).

Sharded ranks are real processes in a real gloo group: T = 2 logits must equal
the unsharded runner's to 1e-4 (fp32) for prefill, multi-token verification,
rollback and refeed, and tree decode, on every architecture preset, including
GQA with fewer KV heads than ranks and a vocabulary that does not split evenly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import ARCHES, save_tiny_checkpoint
from tp_helpers import RUNNER_KWARGS, rank_main, scenario
from saguaro_ray.errors import CheckpointError, ConfigError, JoinTimeout
from saguaro_ray.runtime.data_plane import DataPlaneStore
from saguaro_ray.runtime.wire import new_key
from saguaro_ray.workers.checkpoint import load_decoder, open_checkpoint
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import ShardPlan, TPContext, check_tensor_parallel

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

# (arch, overrides): every preset, plus the awkward splits
CASES = [(arch, {}) for arch in ARCHES] + [
    ("llama", {"num_key_value_heads": 1}),  # one KV head over two ranks: replicated
    ("qwen2", {"vocab_size": 131, "tie_word_embeddings": True}),  # uneven vocabulary, tied LM head
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return [str(save_tiny_checkpoint(root, arch, seed=3, **over)) for arch, over in CASES]


def _assert_sharded_matches(models: list[str], world: int, out_dir) -> None:
    """Run :func:`scenario` on ``world`` spawned ranks, whose group forms
    through the runtime's authenticated store, and compare with one rank."""
    key = new_key()
    with DataPlaneStore(key, host=None) as store:
        mp.spawn(rank_main, args=(world, store.address, key, models, str(out_dir)), nprocs=world, join=True)
    for i, path in enumerate(models):
        reference = scenario(ModelRunner(path, **RUNNER_KWARGS))
        sharded = torch.load(out_dir / f"{i}.pt")
        assert len(sharded) == len(reference)
        for step, (a, b) in enumerate(zip(sharded, reference)):
            assert a.shape == b.shape, (path, step)
            assert (a - b).abs().max().item() < 1e-4, (path, step)


def test_two_ranks_match_one_rank(models, tmp_path):
    _assert_sharded_matches(models, 2, tmp_path)


def test_four_ranks_replicating_two_kv_heads_match_one_rank(tmp_path):
    # 4 query heads over 2 KV heads on 4 ranks: ranks 0-1 share KV head 0, ranks 2-3 head 1;
    # vocabulary 130 splits 33/33/33/31
    model = save_tiny_checkpoint(tmp_path, "llama", seed=5, vocab_size=130)
    _assert_sharded_matches([str(model)], 4, tmp_path)


def test_a_rank_without_the_engine_key_cannot_join_the_group(models):
    """The ranks meet through the data plane's closed store (the TCPStore they
    used let any peer that reached its port read and write the rendezvous):
    a client without the key gets no answer, and nothing is joined."""
    from saguaro_ray.runtime.tp_actors import join_group

    tp = TPContext(ShardPlan.for_rank(open_checkpoint(models[0]).config, 0, 2), exit_on_failure=False)
    with DataPlaneStore(new_key(), host=None) as store:
        with pytest.raises(JoinTimeout, match="tensor-parallel rank 0 .* cannot reach the rendezvous store"):
            join_group(tp, store.address, new_key(), torch.device("cpu"), timeout_s=0.5)
        assert store.drop_reasons.get("bad mac", 0) > 0
    assert tp.group is None and not dist.is_initialized()


def test_a_rank_loads_only_its_slices(models):
    ckpt = open_checkpoint(models[0])  # llama: 4 heads over 2 KV heads, vocab 128
    full = load_decoder(ckpt, torch.device("cpu"), torch.float32)
    cfg = ckpt.config
    d = cfg.head_dim
    for rank in range(2):
        plan = ShardPlan.for_rank(cfg, rank, 2)
        part = load_decoder(ckpt, torch.device("cpu"), torch.float32, TPContext(plan))
        n_full = sum(p.numel() for p in full.parameters())
        n_part = sum(p.numel() for p in part.parameters())
        assert n_part < 0.6 * n_full
        qkv = part.layers[0].attn.qkv.weight
        fq = full.layers[0].attn.qkv.weight
        h = cfg.num_heads
        assert torch.equal(qkv[: 2 * d], fq[rank * 2 * d : (rank + 1) * 2 * d])  # its two query heads
        assert torch.equal(qkv[2 * d : 3 * d], fq[(h + rank) * d : (h + rank + 1) * d])  # its K head
        o = part.layers[0].attn.o.weight
        assert torch.equal(o, full.layers[0].attn.o.weight[:, rank * 2 * d : (rank + 1) * 2 * d])
        assert torch.equal(part.embed.weight, full.embed.weight[rank * 64 : (rank + 1) * 64])


@pytest.mark.parametrize(
    "world, over, match",
    [
        (3, {}, "num_attention_heads=4 is not divisible by target_tp=3"),
        (2, {"intermediate_size": 63}, "intermediate_size=63"),
        (4, {"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 48}, "num_key_value_heads=6 is not divisible"),
        (4, {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 48}, "not a multiple of it"),
        (0, {}, "positive integer"),
    ],
)
def test_unsplittable_models_are_refused(tmp_path, world, over, match):
    cfg = open_checkpoint(save_tiny_checkpoint(tmp_path, "llama", **over)).config
    with pytest.raises(ConfigError, match=match):
        check_tensor_parallel(cfg, world)


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(tmp_path):
    ckpt = open_checkpoint(save_tiny_checkpoint(tmp_path, "llama"))
    wrong = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, intermediate_size=32))
    with pytest.raises(CheckpointError, match="config implies 32 along dimension"):
        load_decoder(wrong, torch.device("cpu"), torch.float32, TPContext(ShardPlan.for_rank(wrong.config, 0, 2)))

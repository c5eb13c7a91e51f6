"""The paged KV block pool: allocation, rollback, freeing, and running out.

``PagedKVCache`` is tested directly for its bookkeeping; capacity failures are
also driven through ``ModelRunner`` (the way the engine hits them), where a
failing call must leave every sequence exactly as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import hf_logits, load_hf_model, save_tiny_checkpoint
from saguaro_ray.errors import ConfigError, OutOfKVBlocksError, PromptTooLongError, SaguaroError
from saguaro_ray.workers.kv_cache import PagedKVCache
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

BS = 4


def make_cache(num_blocks: int = 8, block_size: int = BS) -> PagedKVCache:
    return PagedKVCache(2, num_blocks, block_size, 2, 8, torch.float32, torch.device("cpu"))


def all_blocks(cache: PagedKVCache) -> list[int]:
    return [b for s in cache.seqs.values() for b in s.blocks]


def check_invariants(cache: PagedKVCache) -> None:
    """Every block is either free or owned by exactly one sequence, and each
    sequence owns exactly ceil(length / block_size) blocks."""
    owned = all_blocks(cache)
    assert len(owned) == len(set(owned))
    assert sorted(owned + cache._free) == list(range(cache.num_blocks))
    for s in cache.seqs.values():
        assert len(s.blocks) == -(-s.length // cache.block_size)


# ------------------------------------------------------------ PagedKVCache
def test_layout() -> None:
    c = make_cache(num_blocks=5)
    assert len(c.layers) == 2
    assert c.layers[0][0].shape == (5, BS, 2, 8) and c.layers[0][1].shape == (5, BS, 2, 8)
    assert c.free_blocks == 5 and c.num_blocks == 5


def test_allocation_across_block_boundaries() -> None:
    c = make_cache()
    c.add("a")
    assert c.length("a") == 0 and c.blocks_needed("a", 0) == 0
    assert c.blocks_needed("a", 1) == 1 and c.blocks_needed("a", 4) == 1 and c.blocks_needed("a", 5) == 2
    s1 = c.reserve("a", 3)
    assert len(c.seqs["a"].blocks) == 1 and c.free_blocks == 7
    assert c.blocks_needed("a", 1) == 0 and c.blocks_needed("a", 2) == 1
    s2 = c.reserve("a", 1)  # fills block 0 exactly
    assert len(c.seqs["a"].blocks) == 1
    s3 = c.reserve("a", 6)  # 4 -> 10 tokens: two more blocks
    assert len(c.seqs["a"].blocks) == 3 and c.free_blocks == 5 and c.length("a") == 10
    slots = s1 + s2 + s3
    blocks = c.seqs["a"].blocks
    assert slots == [blocks[i // BS] * BS + i % BS for i in range(10)]
    check_invariants(c)


def test_sequences_never_share_slots() -> None:
    c = make_cache(num_blocks=10)
    for s in "abc":
        c.add(s)
    slots: dict[str, list[int]] = {s: [] for s in "abc"}
    for n in (1, 3, 2, 5, 1, 4):  # interleaved growth -> interleaved blocks
        for s in "abc":
            if c.blocks_needed(s, n) <= c.free_blocks and c.length(s) + n <= 12:
                slots[s] += c.reserve(s, n)
    flat = [x for v in slots.values() for x in v]
    assert len(flat) == len(set(flat))
    assert all(len(slots[s]) == c.length(s) for s in "abc")
    check_invariants(c)


def test_truncate_frees_blocks() -> None:
    c = make_cache()
    c.add("a")
    c.reserve("a", 11)  # 3 blocks
    assert c.free_blocks == 5
    c.truncate("a", 9)  # still 3 blocks
    assert c.free_blocks == 5 and c.length("a") == 9
    c.truncate("a", 8)  # exactly 2 blocks
    assert c.free_blocks == 6 and len(c.seqs["a"].blocks) == 2
    first_block = c.seqs["a"].blocks[0]
    c.truncate("a", 1)
    assert c.free_blocks == 7 and c.seqs["a"].blocks == [first_block]
    c.truncate("a", 0)
    assert c.free_blocks == 8 and c.seqs["a"].blocks == [] and c.length("a") == 0
    check_invariants(c)
    # growing again after truncation reuses the pool
    c.reserve("a", 9)
    assert c.free_blocks == 5
    check_invariants(c)


def test_truncate_to_same_length_is_noop_and_bad_lengths_raise() -> None:
    c = make_cache()
    c.add("a")
    c.reserve("a", 6)
    before = list(c.seqs["a"].blocks)
    c.truncate("a", 6)
    assert c.seqs["a"].blocks == before and c.length("a") == 6
    for bad in (7, -1):
        with pytest.raises(ValueError):
            c.truncate("a", bad)
    assert c.seqs["a"].blocks == before and c.length("a") == 6


def test_free_returns_all_blocks() -> None:
    c = make_cache()
    c.add("a")
    c.add("b")
    c.reserve("a", 9)
    c.reserve("b", 5)
    c.reserve("a", 2)
    assert c.free_blocks == 8 - 3 - 2
    c.free("a")
    assert c.free_blocks == 6 and "a" not in c.seqs
    c.free("b")
    assert c.free_blocks == 8 and not c.seqs
    check_invariants(c)
    c.free("b")  # freeing twice / unknown is harmless
    c.free("never-added")
    assert c.free_blocks == 8
    c.add("a")  # the id can be reused after free
    assert c.length("a") == 0


def test_add_twice_raises() -> None:
    c = make_cache()
    c.add("a")
    with pytest.raises(ValueError, match="already"):
        c.add("a")


def test_reserve_out_of_blocks_changes_nothing() -> None:
    c = make_cache(num_blocks=3)
    c.add("a")
    c.add("b")
    c.reserve("a", 6)  # 2 blocks
    c.reserve("b", 1)  # 1 block -> pool empty
    assert c.free_blocks == 0
    c.reserve("a", 2)  # fits in a's second block: no new block needed
    state = {s: (list(v.blocks), v.length) for s, v in c.seqs.items()}
    with pytest.raises(OutOfKVBlocksError) as exc:
        c.reserve("b", 4)
    assert isinstance(exc.value, SaguaroError)
    assert "'b'" in str(exc.value) and "blocks" in str(exc.value)
    assert {s: (list(v.blocks), v.length) for s, v in c.seqs.items()} == state
    assert c.free_blocks == 0
    c.free("a")
    c.reserve("b", 4)  # now it fits
    check_invariants(c)


def test_block_table_padding() -> None:
    c = make_cache()
    c.add("a")
    c.add("b")
    c.add("empty")
    c.reserve("a", 9)
    c.reserve("b", 2)
    t = c.block_table(["a", "b", "empty"], torch.device("cpu"))
    assert t.shape == (3, 3) and t.dtype == torch.long
    assert t[0].tolist() == c.seqs["a"].blocks
    assert t[1, 0].item() == c.seqs["b"].blocks[0]
    assert t[1, 1:].tolist() == [0, 0] and t[2].tolist() == [0, 0, 0]
    assert c.block_table(["empty"], torch.device("cpu")).shape == (1, 1)


# ------------------------------------------------------ through ModelRunner
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # max_position_embeddings 32 so the context limit is easy to reach
    return save_tiny_checkpoint(tmp_path_factory.mktemp("kv"), "llama", seed=3, max_position_embeddings=32)


@pytest.fixture(scope="module")
def hf(tiny: Path):
    return load_hf_model(tiny)


def toks(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (n,), generator=g).tolist()


def snapshot(r: ModelRunner) -> dict:
    return {s: (list(v.blocks), v.length) for s, v in r.kv.seqs.items()} | {"free": r.kv.free_blocks}


def test_runner_allocates_lazily_and_frees(tiny: Path) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=40)
    assert r.kv.num_blocks == 10 and r.kv.free_blocks == 10
    r.add_sequence("a")
    assert r.has_sequence("a") and r.seq_len("a") == 0 and r.kv.free_blocks == 10
    r.forward(["a"], [toks(1, 5)])
    assert len(r.kv.seqs["a"].blocks) == 2 and r.kv.free_blocks == 8
    for t in toks(2, 3):  # 6, 7, 8 tokens: still two blocks
        r.forward(["a"], [[t]])
    assert len(r.kv.seqs["a"].blocks) == 2 and r.seq_len("a") == 8
    r.forward(["a"], [[7]])  # 9th token opens a third block
    assert len(r.kv.seqs["a"].blocks) == 3 and r.kv.free_blocks == 7
    r.truncate("a", 4)
    assert len(r.kv.seqs["a"].blocks) == 1 and r.kv.free_blocks == 9
    r.free_sequence("a")
    assert not r.has_sequence("a") and r.kv.free_blocks == 10


def test_max_kv_tokens_rounds_up_to_blocks(tiny: Path) -> None:
    assert ModelRunner(tiny, block_size=BS, max_kv_tokens=17).kv.num_blocks == 5
    with pytest.raises(ConfigError, match="block_size"):
        ModelRunner(tiny, block_size=0)


def test_reused_blocks_hold_no_stale_kv(tiny: Path, hf) -> None:
    """Blocks freed by a rollback and handed to another sequence are fully
    overwritten; both sequences keep matching transformers."""
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=24)  # 6 blocks
    a, b = toks(10, 20), toks(11, 10)
    r.add_sequence("a")
    r.add_sequence("b")
    r.forward(["a"], [a[:20]])  # 5 blocks
    r.truncate("a", 5)  # frees 3 blocks (with a's stale K/V in them)
    out = r.forward(["b", "a"], [b, [a[5]]], all_logits=True)
    torch.testing.assert_close(out[:10], hf_logits(hf, b), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[10], hf_logits(hf, a[:6])[-1], atol=1e-4, rtol=0)


def test_out_of_blocks_in_forward_changes_nothing(tiny: Path, hf) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=4 * BS)  # 4 blocks
    seqs = {"a": toks(20, 12), "b": toks(21, 12)}
    r.add_sequence("a")
    r.add_sequence("b")
    r.forward(["a", "b"], [seqs["a"][:6], seqs["b"][:3]])  # a: 2 blocks, b: 1 block
    assert r.kv.free_blocks == 1
    before = snapshot(r)
    # a: 6 -> 9 needs a block, b: 3 -> 6 needs a block: 2 > 1 free
    with pytest.raises(OutOfKVBlocksError, match="KV cache full") as exc:
        r.forward(["a", "b"], [seqs["a"][6:9], seqs["b"][3:6]])
    assert "2" in str(exc.value) and "1 free" in str(exc.value)
    assert snapshot(r) == before
    assert (r.seq_len("a"), r.seq_len("b")) == (6, 3)
    # a smaller forward still works and is still exact (nothing was corrupted)
    out = r.forward(["a", "b"], [seqs["a"][6:8], seqs["b"][3:4]], all_logits=True)
    torch.testing.assert_close(out[:2], hf_logits(hf, seqs["a"][:8])[6:8], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], hf_logits(hf, seqs["b"][:4])[3], atol=1e-4, rtol=0)
    assert (r.seq_len("a"), r.seq_len("b")) == (8, 4) and r.kv.free_blocks == 1
    # one sequence alone may take the last block
    r.forward(["b"], [seqs["b"][4:8]])
    assert r.kv.free_blocks == 0
    before = snapshot(r)
    with pytest.raises(OutOfKVBlocksError):
        r.forward(["a"], [[seqs["a"][8]]])
    assert snapshot(r) == before
    # rollback frees room again
    r.truncate("b", 4)
    out = r.forward(["a"], [[seqs["a"][8]]])
    torch.testing.assert_close(out[0], hf_logits(hf, seqs["a"][:9])[-1], atol=1e-4, rtol=0)


def test_out_of_blocks_in_append_kv_changes_nothing(tiny: Path) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=2 * BS)
    r.add_sequence("a")
    r.forward(["a"], [toks(30, 7)])
    cfg = r.config
    delta = [(torch.zeros(3, cfg.num_kv_heads, cfg.head_dim), torch.zeros(3, cfg.num_kv_heads, cfg.head_dim))] * cfg.num_layers
    before = snapshot(r)
    with pytest.raises(OutOfKVBlocksError):
        r.append_kv("a", delta)
    assert snapshot(r) == before
    r.append_kv("a", [(k[:1], v[:1]) for k, v in delta])  # one token still fits
    assert r.seq_len("a") == 8


def test_out_of_blocks_in_tree_commit_changes_nothing(tiny: Path, hf) -> None:
    """Committing a branch that needs more blocks than are free must fail
    without touching the sequence (not truncate it to the branch prefix first)."""
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=3 * BS)  # 3 blocks
    a, b = toks(40, 9), toks(41, 4)
    r.add_sequence("a")
    r.add_sequence("b")
    r.forward(["a", "b"], [a[:8], b])  # a: 2 blocks, b: 1 block -> pool empty
    tree = r.tree_start(["a"], [7])
    bt = toks(42, 4)
    r.tree_forward(tree, [bt[:2]])
    r.tree_forward(tree, [bt[2:]])
    before = snapshot(r)
    # a[:7] + 4 branch tokens = 11 tokens = 3 blocks, but only 2 are a's and none is free
    with pytest.raises(OutOfKVBlocksError):
        r.tree_commit(tree, 0, 4)
    assert snapshot(r) == before, "a failed tree_commit modified the sequence"
    # with room made, the same commit succeeds and decoding continues exactly
    r.free_sequence("b")
    r.tree_commit(tree, 0, 4)
    assert r.seq_len("a") == 11 and r.kv.free_blocks == 0
    out = r.forward(["a"], [[a[8]]])
    torch.testing.assert_close(out[0], hf_logits(hf, a[:7] + bt + [a[8]])[-1], atol=1e-4, rtol=0)


def test_tree_commit_beyond_context_changes_nothing(tiny: Path) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=256)
    r.add_sequence("a")
    r.forward(["a"], [toks(43, 30)])
    tree = r.tree_start(["a"], [30])
    r.tree_forward(tree, [toks(44, 3)])
    before = snapshot(r)
    with pytest.raises(PromptTooLongError):
        r.tree_commit(tree, 0, 3)  # 33 > 32
    assert snapshot(r) == before
    r.tree_commit(tree, 0, 2)
    assert r.seq_len("a") == 32


def test_prompt_too_long(tiny: Path, hf) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=256)
    assert r.max_context == 32
    r.add_sequence("a")
    r.add_sequence("b")
    long = toks(50, 33)
    with pytest.raises(PromptTooLongError, match="33") as exc:
        r.forward(["a"], [long])
    assert "32" in str(exc.value) and isinstance(exc.value, ValueError)
    assert r.seq_len("a") == 0 and r.kv.free_blocks == r.kv.num_blocks
    # in a batch: the other sequence is not advanced either
    before = snapshot(r)
    with pytest.raises(PromptTooLongError):
        r.forward(["b", "a"], [long[:5], long])
    assert snapshot(r) == before
    # exactly the context fits, one more token does not
    out = r.forward(["a"], [long[:32]], all_logits=True)
    torch.testing.assert_close(out, hf_logits(hf, long[:32]), atol=1e-4, rtol=0)
    before = snapshot(r)
    with pytest.raises(PromptTooLongError):
        r.forward(["a"], [[5]])
    assert snapshot(r) == before
    # a verify step that would overflow also fails cleanly, after rollback it fits
    r.truncate("a", 29)
    with pytest.raises(PromptTooLongError):
        r.forward(["a"], [long[29:33]])
    assert r.seq_len("a") == 29
    r.forward(["a"], [long[29:32]])
    assert r.seq_len("a") == 32


def test_append_kv_beyond_context(tiny: Path) -> None:
    r = ModelRunner(tiny, block_size=BS, max_kv_tokens=256)
    r.add_sequence("a")
    r.forward(["a"], [toks(60, 30)])
    cfg = r.config
    delta = [(torch.zeros(3, cfg.num_kv_heads, cfg.head_dim), torch.zeros(3, cfg.num_kv_heads, cfg.head_dim))] * cfg.num_layers
    with pytest.raises(PromptTooLongError):
        r.append_kv("a", delta)
    assert r.seq_len("a") == 30

"""Parity of ``ModelRunner`` against ``transformers.AutoModelForCausalLM``.

Every supported architecture variant is saved as a tiny random Hugging Face
checkpoint, loaded both by ``transformers`` (fp32, eager attention — the
reference) and by our runner (fp32, torch backend, block size 4 so paging and
block boundaries are exercised constantly). Every way the engine drives the
runner — prefill, AR decode, multi-token verify, rollback, ragged batches,
shared-prefix tree decode, tree commit / KV export — must reproduce the
reference logits of the equivalent plain sequence to 1e-4 (absolute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import hf_logits, load_hf_model, save_tiny_checkpoint
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.rope import inverse_frequencies
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

ATOL = 1e-4
BLOCK = 4
WINDOW = 4  # sliding window of the "mistral-window" variant; sequences here are 10-25 tokens

# variant id -> (helper arch, config overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),  # GQA 4/2, untied
    "llama3": ("llama3", {}),  # llama3 rope scaling, original context 32
    "mistral": ("mistral", {}),
    # Mistral with a window far shorter than the sequences. transformers 5.x
    # honours `sliding_window` in eager and sdpa attention (checked by
    # test_sliding_window_is_active below), so it is a valid reference here.
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {}),  # q/k/v bias (random nonzero values)
    "qwen3": ("qwen3", {}),  # q/k RMSNorm, head_dim 24 != 32/4
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


@dataclass
class Model:
    name: str
    arch: str
    overrides: dict
    path: Path
    hf: torch.nn.Module

    def ref(self, tokens: list[int]) -> torch.Tensor:
        return hf_logits(self.hf, tokens)

    def runner(self, **kw) -> ModelRunner:
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("max_kv_tokens", 512)
        return ModelRunner(self.path, **kw)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def model(request, tmp_path_factory) -> Model:
    arch, overrides = VARIANTS[request.param]
    path = save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=1, **overrides)
    return Model(request.param, arch, overrides, path, load_hf_model(path))


def toks(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (n,), generator=g).tolist()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


# ------------------------------------------------------------------ sanity
def test_variant_features(model: Model) -> None:
    """The checkpoint really has the feature the variant is meant to cover."""
    cfg = open_checkpoint(model.path).config
    name = model.name
    assert cfg.num_kv_heads < cfg.num_heads  # GQA everywhere
    assert cfg.qkv_bias == (name in ("qwen2", "llama-bias"))
    assert cfg.o_bias == cfg.mlp_bias == (name == "llama-bias")
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.tie_word_embeddings == name.endswith("-tied")
    assert cfg.sliding_window == (WINDOW if name == "mistral-window" else None)
    if name.startswith("qwen3"):
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads
    if name == "llama3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta, None)
        scaled = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        ratio = plain / scaled
        # all three regimes present: kept (1), divided by factor (8), blended (between)
        assert torch.isclose(ratio, torch.tensor(1.0)).any()
        assert torch.isclose(ratio, torch.tensor(8.0)).any()
        assert ((ratio > 1.01) & (ratio < 7.99)).any()
    else:
        assert cfg.rope_scaling is None
    if name.endswith("-tied"):
        names = json.loads((model.path / "config.json").read_text())
        assert names["tie_word_embeddings"] is True


@pytest.mark.parametrize("model", ["mistral-window"], indirect=True)
def test_sliding_window_is_active(model: Model) -> None:
    """For the windowed variant, the window changes the reference logits (so
    the parity tests really test it) and we match the windowed reference."""
    seq = toks(7, 16)
    ref = model.ref(seq)
    unwindowed = hf_logits(load_hf_model(model.path, sliding_window=None), seq)
    # identical while the whole prefix fits the window, different afterwards
    close(unwindowed[:WINDOW], ref[:WINDOW])
    assert (unwindowed[WINDOW:] - ref[WINDOW:]).abs().amax(dim=-1).min() > 1e-3
    r = model.runner()
    r.add_sequence("s")
    close(r.forward(["s"], [seq], all_logits=True), ref)


# ------------------------------------------------------- paged forward paths
def test_prefill_then_decode(model: Model) -> None:
    seq = toks(1, 22)
    ref = model.ref(seq)
    r = model.runner()
    r.add_sequence("a")
    close(r.forward(["a"], [seq[:11]], all_logits=True), ref[:11])
    assert r.seq_len("a") == 11
    for i in range(11, 22):
        out = r.forward(["a"], [[seq[i]]])
        assert out.shape == (1, ref.shape[-1]) and out.dtype == torch.float32
        close(out[0], ref[i])
    assert r.seq_len("a") == 22


def test_prefill_last_logits_only(model: Model) -> None:
    seq = toks(2, 9)
    r = model.runner()
    r.add_sequence("a")
    out = r.forward(["a"], [seq])
    assert out.shape == (1, model.hf.config.vocab_size)
    close(out[0], model.ref(seq)[-1])


def test_multi_token_verify(model: Model) -> None:
    seq = toks(3, 19)
    ref = model.ref(seq)
    r = model.runner()
    r.add_sequence("a")
    r.forward(["a"], [seq[:7]])
    close(r.forward(["a"], [seq[7:12]], all_logits=True), ref[7:12])  # 5 tokens
    close(r.forward(["a"], [seq[12:16]], all_logits=True), ref[12:16])  # 4 tokens
    close(r.forward(["a"], [seq[16:19]])[0], ref[18])  # last-only
    assert r.seq_len("a") == 19


def test_rollback_then_refeed(model: Model) -> None:
    seq = toks(4, 13)
    alt = toks(5, 9)
    r = model.runner()
    r.add_sequence("a")
    r.forward(["a"], [seq[:9]])
    r.forward(["a"], [seq[9:13]], all_logits=True)  # a rejected 4-token speculation
    blocks_before = r.kv.free_blocks
    r.truncate("a", 6)  # back across a block boundary (13 -> 6 tokens: 4 -> 2 blocks)
    assert r.seq_len("a") == 6
    assert r.kv.free_blocks == blocks_before + 2
    ref = model.ref(seq[:6] + alt)
    close(r.forward(["a"], [alt[:5]], all_logits=True), ref[6:11])
    for i in range(5, 9):
        close(r.forward(["a"], [[alt[i]]])[0], ref[6 + i])
    # roll back again to inside the just-fed block and continue
    r.truncate("a", 12)
    other = toks(6, 3)
    ref2 = model.ref(seq[:6] + alt[:6] + other)
    close(r.forward(["a"], [other], all_logits=True), ref2[12:])


def test_ragged_batch(model: Model) -> None:
    seqs = {"x": toks(10, 16), "y": toks(11, 20), "z": toks(12, 13)}
    refs = {k: model.ref(v) for k, v in seqs.items()}
    r = model.runner()
    for k in seqs:
        r.add_sequence(k)
    order = ["x", "y", "z"]
    fed = {k: 0 for k in order}

    def step(counts: dict[str, int], all_logits: bool, order=order) -> None:
        new = [seqs[k][fed[k] : fed[k] + counts[k]] for k in order]
        out = r.forward(order, new, all_logits=all_logits)
        row = 0
        for k in order:
            n = counts[k]
            want = refs[k][fed[k] : fed[k] + n]
            if all_logits:
                close(out[row : row + n], want)
                row += n
            else:
                close(out[row], want[-1])
                row += 1
            fed[k] += n
        assert out.shape[0] == row

    step({"x": 3, "y": 9, "z": 6}, all_logits=True)  # ragged prefill
    step({"x": 1, "y": 4, "z": 2}, all_logits=True)  # decode / verify mixed
    step({"x": 5, "y": 1, "z": 3}, all_logits=False)
    step({"x": 2, "y": 3, "z": 1}, all_logits=True, order=["z", "x", "y"])  # another order
    # rollback one of them mid-batch, then keep going ragged
    r.truncate("y", 10)
    fed["y"] = 10
    step({"x": 4, "y": 6, "z": 1}, all_logits=True)
    assert [r.seq_len(k) for k in order] == [fed[k] for k in order] == [15, 16, 13]


def test_default_block_size(model: Model) -> None:
    """The default block size (16) gives the same logits as block size 4."""
    seq = toks(13, 21)
    ref = model.ref(seq)
    r = model.runner(block_size=None, max_kv_tokens=None)
    assert r.kv.block_size == 16
    r.add_sequence(0)
    close(r.forward([0], [seq[:17]], all_logits=True), ref[:17])
    close(r.forward([0], [seq[17:]], all_logits=True), ref[17:])


# --------------------------------------------------------------- tree decode
# Two cached sequences A (14 tokens) and B (9 tokens); branches continue them
# at different prefix lengths, interleaved, with repeats of the same prefix.
A_LEN, B_LEN = 14, 9
BRANCHES = [("A", 5), ("A", 14), ("B", 9), ("A", 1), ("B", 4), ("A", 14), ("B", 9)]


def _tree_setup(model: Model, r: ModelRunner) -> dict[str, list[int]]:
    prefix = {"A": toks(20, A_LEN), "B": toks(21, B_LEN)}
    r.add_sequence("A")
    r.add_sequence("B")
    r.forward(["A", "B"], [prefix["A"], prefix["B"]])
    return prefix


@pytest.mark.parametrize("steps", [(1, 1, 1), (1, 2, 1), (3, 2)], ids=lambda s: "-".join(map(str, s)))
def test_tree_decode(model: Model, steps: tuple[int, ...]) -> None:
    r = model.runner()
    prefix = _tree_setup(model, r)
    depth = sum(steps)
    branch_toks = [toks(100 + i, depth) for i in range(len(BRANCHES))]
    tree = r.tree_start([s for s, _ in BRANCHES], [p for _, p in BRANCHES])
    outs = []
    done = 0
    for n in steps:
        out = r.tree_forward(tree, [bt[done : done + n] for bt in branch_toks])
        assert out.shape == (len(BRANCHES), n, model.hf.config.vocab_size)
        outs.append(out)
        done += n
        assert tree.suffix_len == done
    got = torch.cat(outs, dim=1)  # [N, depth, V]
    for i, (s, plen) in enumerate(BRANCHES):
        full = prefix[s][:plen] + branch_toks[i]
        close(got[i], model.ref(full)[plen:])
    # the tree leaves the sequences untouched: plain decode still matches
    assert (r.seq_len("A"), r.seq_len("B")) == (A_LEN, B_LEN)
    nxt = toks(22, 2)
    out = r.forward(["A", "B"], [[nxt[0]], [nxt[1]]])
    close(out[0], model.ref(prefix["A"] + nxt[:1])[-1])
    close(out[1], model.ref(prefix["B"] + nxt[1:])[-1])


def test_tree_explicit_positions(model: Model) -> None:
    """Passing the default positions explicitly changes nothing."""
    r = model.runner()
    prefix = _tree_setup(model, r)
    tree = r.tree_start(["A", "B"], [10, 3])
    bt = [toks(30, 2), toks(31, 2)]
    pos = torch.tensor([[10, 11], [3, 4]])
    out = r.tree_forward(tree, bt, positions=pos)
    close(out[0], model.ref(prefix["A"][:10] + bt[0])[10:])
    close(out[1], model.ref(prefix["B"][:3] + bt[1])[3:])


def test_tree_commit_then_decode(model: Model) -> None:
    r = model.runner()
    prefix = _tree_setup(model, r)
    branches = [("A", 5), ("B", 9), ("A", 14), ("B", 4)]
    branch_toks = [toks(40 + i, 3) for i in range(len(branches))]
    tree = r.tree_start([s for s, _ in branches], [p for _, p in branches])
    r.tree_forward(tree, [bt[:1] for bt in branch_toks])
    r.tree_forward(tree, [bt[1:] for bt in branch_toks])
    # accept 3 tokens of branch 0 (A: 14 -> 5 + 3) and 2 of branch 3 (B: 9 -> 4 + 2)
    r.tree_commit(tree, 0, 3)
    r.tree_commit(tree, 3, 2)
    assert r.seq_len("A") == 8 and r.seq_len("B") == 6
    a_hist = prefix["A"][:5] + branch_toks[0]
    b_hist = prefix["B"][:4] + branch_toks[3][:2]
    na, nb = toks(50, 5), toks(51, 5)
    ref_a = model.ref(a_hist + na)
    ref_b = model.ref(b_hist + nb)
    out = r.forward(["A", "B"], [na[:3], nb[:1]], all_logits=True)  # verify + decode
    close(out[:3], ref_a[8:11])
    close(out[3], ref_b[6])
    for i in range(3, 5):
        out = r.forward(["A", "B"], [[na[i]], [nb[i - 2]]])
        close(out[0], ref_a[8 + i])
        close(out[1], ref_b[6 + i - 2])


def test_tree_commit_at_sequence_end(model: Model) -> None:
    """A branch continuing the full sequence (prefix_len == seq_len) commits by
    appending; committing 0 tokens just rolls back to the prefix."""
    r = model.runner()
    prefix = _tree_setup(model, r)
    tree = r.tree_start(["A", "B"], [A_LEN, 6])
    bt = [toks(60, 4), toks(61, 4)]
    r.tree_forward(tree, [b[:2] for b in bt])
    r.tree_forward(tree, [b[2:] for b in bt])
    r.tree_commit(tree, 0, 4)
    r.tree_commit(tree, 1, 0)
    assert r.seq_len("A") == A_LEN + 4 and r.seq_len("B") == 6
    nxt = toks(62, 2)
    out = r.forward(["A", "B"], [[nxt[0]], [nxt[1]]])
    close(out[0], model.ref(prefix["A"] + bt[0] + nxt[:1])[-1])
    close(out[1], model.ref(prefix["B"][:6] + nxt[1:])[-1])


def test_tree_export_append_kv(model: Model) -> None:
    """A branch's KV delta, exported from one runner, continues the sequence in
    a second runner (same weights, different block size) exactly."""
    r1 = model.runner()
    prefix = _tree_setup(model, r1)
    r2 = model.runner(block_size=3)
    r2.add_sequence("full")
    r2.add_sequence("short")
    r2.forward(["full", "short"], [prefix["A"], prefix["A"][:6]])
    tree = r1.tree_start(["A", "A", "B"], [A_LEN, 6, 9])
    bt = [toks(70 + i, 4) for i in range(3)]
    r1.tree_forward(tree, [b[:2] for b in bt])
    r1.tree_forward(tree, [b[2:] for b in bt])
    d0 = r1.tree_export(tree, 0, 3)
    d1 = r1.tree_export(tree, 1, 4)
    cfg = r1.config
    assert len(d0) == cfg.num_layers
    assert d0[0][0].shape == (3, cfg.num_kv_heads, cfg.head_dim)
    r2.append_kv("full", d0)
    r2.append_kv("short", d1)
    assert r2.seq_len("full") == A_LEN + 3 and r2.seq_len("short") == 10
    # exporting copies: r1's later tree work must not disturb r2's cache
    r1.tree_forward(tree, [[5], [6], [7]])
    nf, ns = toks(72, 4), toks(73, 4)
    ref_f = model.ref(prefix["A"] + bt[0][:3] + nf)
    ref_s = model.ref(prefix["A"][:6] + bt[1] + ns)
    out = r2.forward(["full", "short"], [nf, ns[:2]], all_logits=True)
    close(out[:4], ref_f[A_LEN + 3 :])
    close(out[4:], ref_s[10:12])
    close(r2.forward(["short"], [ns[2:]], all_logits=True), ref_s[12:])


# ---------------------------------------------------------------- loading
def test_sharded_checkpoint(model: Model, tmp_path: Path) -> None:
    arch, overrides = VARIANTS[model.name]
    path = save_tiny_checkpoint(tmp_path, arch, seed=1, max_shard_size="20KB", tokenizer=False, **overrides)
    assert (path / "model.safetensors.index.json").is_file()
    assert not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    r = ModelRunner(open_checkpoint(path, require_tokenizer=False), block_size=BLOCK, max_kv_tokens=128)
    unsharded = model.runner()
    for (n1, p1), (n2, p2) in zip(r.model.named_parameters(), unsharded.model.named_parameters()):
        assert n1 == n2
        assert torch.equal(p1, p2), n1
    seq = toks(80, 15)
    r.add_sequence(0)
    close(r.forward([0], [seq], all_logits=True), model.ref(seq))


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3", "mistral-window"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision(model: Model, dtype: torch.dtype) -> None:
    """Half-precision runners load and run every path; logits are finite and
    their argmax agrees with fp32 on most positions (loose on purpose)."""
    r = model.runner(dtype=dtype)
    assert r.dtype == dtype and r.kv.layers[0][0].dtype == dtype
    seq = toks(90, 24)
    ref = model.ref(seq)
    r.add_sequence("a")
    got = [r.forward(["a"], [seq[:16]], all_logits=True)]
    for i in range(16, 20):
        got.append(r.forward(["a"], [[seq[i]]]))
    got.append(r.forward(["a"], [seq[20:]], all_logits=True))
    out = torch.cat(got)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"{dtype}: argmax agreement with fp32 only {agree:.2f}"
    # tree decode and commit run in half precision too
    tree = r.tree_start(["a", "a"], [24, 10])
    bt = [toks(91, 2), toks(92, 2)]
    t_out = r.tree_forward(tree, bt)
    assert torch.isfinite(t_out).all()
    t_ref = torch.stack([model.ref(seq + bt[0])[24:], model.ref(seq[:10] + bt[1])[10:]])
    assert (t_out.argmax(-1) == t_ref.argmax(-1)).float().mean().item() >= 0.5
    r.tree_commit(tree, 1, 2)
    assert r.seq_len("a") == 12
    assert torch.isfinite(r.forward(["a"], [[seq[0]]])).all()


# -------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["llama", "qwen3", "mistral-window"], indirect=True)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cuda_runner(model: Model, backend: str) -> None:
    """On CUDA: the torch backend in fp32 matches the CPU reference closely;
    the auto backend (flash-attn when importable, bf16) agrees on argmax."""
    fp32 = backend == "torch"
    r = model.runner(device="cuda", dtype=torch.float32 if fp32 else torch.bfloat16,
                     attention_backend=backend, block_size=None)
    a, b = toks(200, 24), toks(201, 14)
    ref_a, ref_b = model.ref(a), model.ref(b)
    r.add_sequence("a")
    r.add_sequence("b")
    outs = [r.forward(["a", "b"], [a[:16], b[:5]], all_logits=True)]
    outs.append(r.forward(["a", "b"], [a[16:17], b[5:9]], all_logits=True))
    outs.append(r.forward(["a", "b"], [a[17:21], b[9:10]], all_logits=True))
    got = torch.cat(outs).cpu()
    want = torch.cat([ref_a[:16], ref_b[:5], ref_a[16:17], ref_b[5:9], ref_a[17:21], ref_b[9:10]])
    tree = r.tree_start(["a", "b", "a"], [21, 10, 8])
    bt = [toks(202 + i, 2) for i in range(3)]
    t_got = r.tree_forward(tree, bt).cpu().reshape(6, -1)
    t_want = torch.cat([model.ref(a[:21] + bt[0])[21:], model.ref(b[:10] + bt[1])[10:], model.ref(a[:8] + bt[2])[8:]])
    if fp32:
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        torch.testing.assert_close(t_got, t_want, atol=1e-3, rtol=0)
    else:
        assert torch.isfinite(got).all() and torch.isfinite(t_got).all()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
        assert (t_got.argmax(-1) == t_want.argmax(-1)).float().mean() >= 0.5

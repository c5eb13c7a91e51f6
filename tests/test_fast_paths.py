"""The fast paths agree with the plain ones they replace (no timings asserted).

* oneDNN pre-packed linear layers vs ``torch.nn.functional.linear``;
* the tree attention's joint form (one masked attention over prefix + every
  branch's suffix) vs its cascade form (prefix and suffix merged by LSE);
* per-position uniforms from a re-seeded generator vs fresh generators;
* greedy verification without uniforms vs with them;
* greedy verification in closed form (one argmax) vs the general rule, for any q.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from saguaro_ray.algorithms.sampling import position_generator, position_uniforms, process_logits, uniforms
from saguaro_ray.algorithms.verification import greedy_outcomes, verify
from saguaro_ray.kernels.attention import TorchBackend, TreeBatch
from saguaro_ray.kernels.linear import EXACT_ROWS, PackedLinear, linear_kernel, pack_linears, packing_available, row_bucket

CPU = torch.device("cpu")


@pytest.mark.skipif(not packing_available(CPU, torch.float32), reason="oneDNN linear packing not available")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear.from_linear(lin)
    assert packed.weight is lin.weight and packed.bias is lin.bias
    with torch.inference_mode():
        for rows in (1, 5, 33):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(packed(x), nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, 48)
        torch.testing.assert_close(packed(x), nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        one = torch.randn(1, 1, 48)
        assert packed(one).shape == (1, 1, 80)


def _packed(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> PackedLinear:
    """A seeded random linear layer, packed (the test skips where oneDNN cannot pack ``dtype``)."""
    if not packing_available(CPU, dtype):
        pytest.skip(f"oneDNN packing not available for {dtype}")
    torch.manual_seed(0)
    return PackedLinear.from_linear(nn.Linear(in_features, out_features, bias=bias).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_is_row_invariant(dtype: torch.dtype) -> None:
    """A row's product has the same bits whether it comes alone (a decode step)
    or among others (a verification, a batch): oneDNN alone sums one row in
    another order (off by ~2e-6 in fp32 at this shape before the fix)."""
    packed = _packed(1536, 1536, False, dtype)
    x = torch.randn(17, 1536, dtype=dtype)
    with torch.inference_mode():
        every = packed(x)
        for rows in (1, 2, 5, 9, 16):
            assert torch.equal(packed(x[:rows]), every[:rows]), rows
        for i in (0, 7, 16):
            assert torch.equal(packed(x[i]), every[i])


@pytest.mark.parametrize("rows", [32, 96])
def test_a_bf16_row_has_the_same_bits_among_any_number_of_rows(rows: int) -> None:
    """A bf16 row's product is the same among any number of rows: one oneDNN call
    of 2-32 rows sums a row in one order, and larger inputs are split into such
    calls (one call of 33+ rows sums in another order, which depends on the count)."""
    packed = _packed(896, 4864, False, torch.bfloat16)
    x = torch.randn(rows, 896, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        two = packed(x[:2])
        assert all(torch.equal(packed(x[:m])[:2], two) for m in range(2, rows + 1))


def test_row_buckets_bound_the_shapes_and_the_padding() -> None:
    """Every row count maps to a bucket at least as large and at most 1/8 larger,
    exact up to EXACT_ROWS, and 1..2048 rows need 72 shapes (not 2,048)."""
    assert [row_bucket(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert all(r <= row_bucket(r) <= r * 9 / 8 and row_bucket(row_bucket(r)) == row_bucket(r) for r in range(1, 20_000))
    assert len({row_bucket(r) for r in range(1, 2049)}) == 72


@pytest.mark.parametrize("dtype, counts", [(torch.float32, (17, 19, 33, 100, 257, 699)), (torch.bfloat16, (17, 19, 25, 31))])
def test_padding_rows_to_a_bucket_changes_no_bit(dtype: torch.dtype, counts: tuple[int, ...]) -> None:
    """The bucketed product of each row equals oneDNN's product at the exact row
    count (what ran before bucketing), for counts inside and at the edge of buckets
    and a 3-D input (a prefill's [1, T, D]). bf16 only up to 32 rows: larger
    inputs are split into calls of at most 32 (the test above)."""
    packed = _packed(576, 1536, True, dtype)
    x = torch.randn(700, 576, dtype=dtype)
    with torch.inference_mode():
        for rows in counts:
            assert row_bucket(rows) != rows
            exact = torch.ops.mkldnn._linear_pointwise(x[:rows], packed._packed, packed._bias, "none", [], "")
            assert torch.equal(packed(x[:rows]), exact), rows
            assert torch.equal(packed(x[:rows].unsqueeze(0)), exact.unsqueeze(0)), rows


def test_pack_linears_respects_device_dtype_and_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert pack_linears(model, CPU, torch.float16) == 0
    monkeypatch.setenv("SAGUARO_LINEAR_KERNEL", "dense")
    assert pack_linears(model, CPU, torch.float32, linear_kernel()) == 0
    assert all(type(m) is not PackedLinear for m in model)


def _tree_inputs(window: int | None):
    torch.manual_seed(1)
    bs, blocks, hkv, hq, d = 4, 24, 2, 4, 8
    k_cache = torch.randn(blocks, bs, hkv, d)
    v_cache = torch.randn(blocks, bs, hkv, d)
    # two prefix sequences with scattered blocks; branches interleaved and uneven
    tables = [[5, 2, 9, 11], [7, 1, 3]]
    branch_seq = [1, 0, 0, 1, 0]
    prefix_lens = [10, 13, 7, 12, 16]
    n_new, sfx = 2, 3
    nb = len(branch_seq)
    k_scr = torch.randn(8, 8, hkv, d)
    v_scr = torch.randn(8, 8, hkv, d)
    q = torch.randn(nb * n_new, hq, d)
    width = max(map(len, tables))
    batch = TreeBatch(
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        branch_seq=branch_seq,
        prefix_lens=prefix_lens,
        suffix_len=sfx,
        n_new=n_new,
        block_size=bs,
        block_lists=tables,
    )
    return batch, q, k_cache, v_cache, k_scr, v_scr


@pytest.mark.parametrize("window", [None, 6])
def test_tree_joint_and_cascade_agree(window: int | None) -> None:
    batch, q, kc, vc, ks, vs = _tree_inputs(window)
    joint, cascade = TorchBackend(), TorchBackend()
    joint.cascade_factor, joint.cascade_slack = 10**9, 10**9
    cascade.cascade_factor, cascade.cascade_slack = -1, -1
    pj = joint.plan_tree(batch, window, CPU)
    pc = cascade.plan_tree(batch, window, CPU)
    assert pj.cascade is None and pc.cascade is not None
    out_j = joint.tree(pj, q, kc, vc, ks, vs, 0.3)
    out_c = cascade.tree(pc, q, kc, vc, ks, vs, 0.3)
    torch.testing.assert_close(out_j, out_c, rtol=1e-5, atol=1e-5)


def test_position_uniforms_equal_fresh_generators() -> None:
    seeds, positions = [3, 5, 7, 3], [0, 10, 99, 0]
    for n in (1, 2):
        for stream in (0, 1, 2):
            fresh = uniforms([position_generator(s, p, stream) for s, p in zip(seeds, positions)], n)
            assert torch.equal(position_uniforms(seeds, positions, n, stream), fresh)
    assert position_uniforms([], [], 2).shape == (0, 2)


def test_greedy_verification_does_not_depend_on_uniforms() -> None:
    torch.manual_seed(2)
    b, k, vocab = 6, 4, 11
    logits = torch.randn(b, k + 1, vocab)
    p = process_logits(logits, [0.0] * (b * (k + 1)))
    assert torch.equal(p.sum(-1), torch.ones(b, k + 1))
    best = logits.argmax(-1)
    tokens = torch.where(torch.rand(b, k) < 0.6, best[:, :k], torch.randint(0, vocab, (b, k)))
    lens = torch.tensor([4, 4, 3, 0, 2, 4])
    ref = verify(p, tokens, None, lens, torch.rand(b, k + 1, 2, dtype=torch.float64))
    got = verify(p, tokens, None, lens, torch.zeros(b, k + 1, 2, dtype=torch.float64))
    assert torch.equal(ref.accepted, got.accepted) and torch.equal(ref.next_token, got.next_token)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_outcomes_equal_the_general_rule(with_q: bool) -> None:
    torch.manual_seed(3)
    b, k, vocab = 64, 4, 7
    # small integer logits: many rows have tied maxima (the lowest id wins)
    logits = torch.randint(0, 4, (b, k + 1, vocab)).float()
    best = process_logits(logits, [0.0] * (b * (k + 1))).argmax(-1)
    tokens = torch.where(torch.rand(b, k) < 0.7, best[:, :k], torch.randint(0, vocab, (b, k)))
    lens = torch.randint(0, k + 1, (b,))
    q = None
    if with_q:  # any law that could have drawn the tokens
        q = torch.rand(b, k, vocab) + 0.01
        q = q / q.sum(-1, keepdim=True)
    p = process_logits(logits, [0.0] * (b * (k + 1)))
    ref = verify(p, tokens, q, lens, torch.rand(b, k + 1, 2, dtype=torch.float64))
    # the closed form takes flat rows, len + 1 per sequence, and ragged token lists
    flat = torch.cat([logits[i, : int(n) + 1] for i, n in enumerate(lens)])
    got = greedy_outcomes(flat, [tokens[i, : int(n)].tolist() for i, n in enumerate(lens)])
    assert got == list(zip(ref.accepted.tolist(), ref.next_token.tolist()))
    assert any(a == int(n) for (a, _), n in zip(got, lens)) and any(a < int(n) for (a, _), n in zip(got, lens))
    with pytest.raises(ValueError):
        greedy_outcomes(flat[:-1], [tokens[i, : int(n)].tolist() for i, n in enumerate(lens)])

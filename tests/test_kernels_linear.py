"""Packed fp32/bf16 linears against ``F.linear`` in the same dtype, the packed
LM head (tied or not), and the kernel choice (no timings asserted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import save_tiny_checkpoint
from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.linear import PackedLinear, pack_linears, packing_available
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

CPU = torch.device("cpu")
ROWS = (1, 5, 8, 17)
DTYPES = [torch.float32, torch.bfloat16]


def _skip_unless_packable(dtype: torch.dtype) -> None:
    if not packing_available(CPU, dtype):
        pytest.skip(f"oneDNN packing not available for {dtype} here")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_flinear_in_its_dtype(dtype: torch.dtype, bias: bool) -> None:
    _skip_unless_packable(dtype)
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear.from_linear(lin)
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, 96).to(dtype)
            got = packed(x)
            assert got.dtype == dtype
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))
        x = torch.randn(2, 3, 96).to(dtype)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias))


def test_pack_linears_packs_bf16() -> None:
    _skip_unless_packable(torch.bfloat16)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(torch.bfloat16)
    assert pack_linears(model, CPU, torch.bfloat16) == 2
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2]))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tied"), "llama", seed=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("untied"), "llama", seed=4)


def _logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    runner.add_sequence("s")
    out = runner.forward(["s"], [tokens], all_logits=True)
    runner.free_sequence("s")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_runner_packs_every_linear_and_the_head(which: str, dtype: torch.dtype, request, monkeypatch) -> None:
    """Every projection and the LM head run packed; a tied head still reads
    the embedding's parameter; logits equal the dense runner's for 1/5/8/17 rows."""
    _skip_unless_packable(dtype)
    path = request.getfixturevalue(which)
    packed = ModelRunner(path, dtype=dtype, max_kv_tokens=256)
    model = packed.model
    assert isinstance(model.lm_head, PackedLinear)
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert (model.lm_head.weight is model.embed.weight) == (which == "tied")
    # one copy of the weights: every packed layer but a tied head dropped its dense weight
    kept = [m for m in model.modules() if isinstance(m, PackedLinear) and m.weight is not None]
    assert kept == ([model.lm_head] if which == "tied" else [])
    monkeypatch.setenv("SAGUARO_LINEAR_KERNEL", "dense")
    dense = ModelRunner(path, dtype=dtype, max_kv_tokens=256)
    assert not any(isinstance(m, PackedLinear) for m in dense.model.modules())
    assert (dense.model.lm_head.weight is dense.model.embed.weight) == (which == "tied")
    g = torch.Generator().manual_seed(5)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for rows in ROWS:
        tokens = torch.randint(3, 99, (rows,), generator=g).tolist()
        torch.testing.assert_close(_logits(packed, tokens), _logits(dense, tokens), **tol)


def test_tied_head_loads_the_embedding(tied) -> None:
    """The tied head's logits are the hidden states times the checkpoint's embedding."""
    from safetensors import safe_open

    runner = ModelRunner(tied, max_kv_tokens=64)
    with safe_open(tied / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    hidden = torch.randn(3, embed.shape[1])
    with torch.inference_mode():
        torch.testing.assert_close(runner.model.logits(hidden), hidden @ embed.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["fast", "int"])
def test_bad_kernel_choice_is_a_config_error(value: str, untied, monkeypatch) -> None:
    monkeypatch.setenv("SAGUARO_LINEAR_KERNEL", value)
    with pytest.raises(ConfigError, match="SAGUARO_LINEAR_KERNEL"):
        ModelRunner(untied, max_kv_tokens=64)

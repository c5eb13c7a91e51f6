"""Weight-only quantised linears and a quantised runner as a self-draft.

* the rounding: every dequantised weight lies within half a step of the original;
* every kernel path (int kernel, packed bf16, dense, the automatic dispatch)
  computes ``x @ dequantize(W).T + b``;
* a quantised tiny-zoo runner's prefill / decode / verify / tree decode /
  tree commit / KV export agree with each other (it is one model whichever
  path runs it), and as the draft of SD and SSD it leaves the target's
  greedy tokens unchanged (no timings asserted).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from saguaro_ray.config import SamplingParams, SpeculationConfig
from saguaro_ray.engine import LocalEngine
from saguaro_ray.runtime.engine_config import EngineConfig
from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.linear import LINEAR_KERNELS, packing_available
from saguaro_ray.kernels.quantized import (
    INT4_GROUP32,
    INT8_PER_CHANNEL,
    SCHEMES,
    QuantizedLinear,
    quantize_decoder,
    quantize_weight,
)
from saguaro_ray.workers.checkpoint import open_checkpoint
from saguaro_ray.workers.decoder import Decoder
from saguaro_ray.workers.model_config import DecoderConfig
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.workers.tensor_parallel import ShardPlan, TPContext

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs

CPU = torch.device("cpu")
ROWS = (1, 4, 5, 8, 9, 17)  # either side of each format's int_rows
# the int kernels and oneDNN compute in bf16: outputs carry bf16 rounding
TOL = {"rtol": 2e-2, "atol": 2e-2}
# ...and a runner's logits come out of a bf16 head, one bf16 step apart (1/32 at |logit| >= 4)
# between paths whose hidden states differ by rounding
RUNNER_TOL = {"rtol": 2e-2, "atol": 8e-2}


FORMATS = {"int8": INT8_PER_CHANNEL, "int4-g32": INT4_GROUP32}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rounding_is_within_half_a_step(fmt: str) -> None:
    qs = FORMATS[fmt]
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 96)  # input columns of very different size
    q = quantize_weight(w, qs)
    err = (q.dequantize() - w).abs()
    if qs.group_size is None:
        assert q.codes.dtype == torch.int8 and int(q.codes.abs().max()) == 127
        step = q.scales.float()[:, None].expand_as(w)
    else:
        assert 0 <= int(q.codes.min()) and int(q.codes.max()) == 2**qs.bits - 1
        step = q.scales.float().repeat_interleave(qs.group_size, dim=1)
    assert bool((err <= step / 2 * 1.02 + 1e-6).all())  # half a step (+ the bf16 zero's rounding)


@pytest.mark.parametrize("kernel", list(LINEAR_KERNELS))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_computes_the_dequantized_product(fmt: str, kernel: str, bias: bool) -> None:
    if kernel in ("auto", "packed") and not packing_available(CPU, torch.bfloat16):
        pytest.skip("oneDNN bf16 not available here")
    torch.manual_seed(1)
    lin = nn.Linear(64, 40, bias=bias)  # 40 output channels: the int4 kernel's rows are padded to 48
    q = QuantizedLinear(lin.weight, lin.bias, FORMATS[fmt], kernel, torch.float32)
    ref_w = quantize_weight(lin.weight, FORMATS[fmt]).dequantize()
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, 64)
            got = q(x)
            assert got.shape == (rows, 40) and got.dtype == torch.float32
            torch.testing.assert_close(got, F.linear(x, ref_w, lin.bias), **TOL)
        x = torch.randn(2, 3, 64)
        torch.testing.assert_close(q(x), F.linear(x, ref_w, lin.bias), **TOL)
        if kernel != "dense":  # a bf16 model's activations go in and come out as they are
            x = torch.randn(2, 3, 64)
            got = q(x.bfloat16())
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), F.linear(x, ref_w, lin.bias), **TOL)


def test_bad_schemes_and_shapes_are_config_errors(zoo_tiny) -> None:
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        ModelRunner(zoo_tiny / "target", quantize="int3")
    target = open_checkpoint(zoo_tiny / "target")
    with pytest.raises(ConfigError, match="tensor-parallel"):
        ModelRunner(target, quantize="int8", tp=TPContext(ShardPlan.for_rank(target.config, 0, 2)))
    cfg = DecoderConfig.from_hf(
        {"model_type": "llama", "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
    )
    with pytest.raises(ConfigError, match="divisible by 32"):
        quantize_decoder(Decoder(cfg, CPU), "int4", torch.float32)


@pytest.fixture(scope="module", params=list(SCHEMES))
def qrunner(request, zoo_tiny) -> ModelRunner:
    return ModelRunner(zoo_tiny / "target", quantize=request.param, block_size=4, max_kv_tokens=512)


def test_quantized_runner_replaces_every_linear(qrunner: ModelRunner) -> None:
    model, qs = qrunner.model, SCHEMES[qrunner.quantize]
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == qs.head.bits
    assert all(layer.mlp.down.bits == qs.linears.bits for layer in model.layers)
    assert model.embed.weight.dtype == torch.float32  # embedding rows stay exact


def _toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(r: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits of every position, one token per forward (the 1-row kernel)."""
    r.add_sequence("ref")
    out = torch.cat([r.forward(["ref"], [[t]]) for t in tokens])
    r.free_sequence("ref")
    return out


def test_quantized_runner_paths_agree(qrunner: ModelRunner) -> None:
    """Prefill (many rows), decode, verification and tree decode of the same
    tokens give the same logits up to bf16 rounding of the different kernels."""
    r = qrunner
    prompt, cont = _toks(1, 11), _toks(2, 6)
    ref = _reference(r, prompt + cont)
    r.add_sequence("a")
    pre = r.forward(["a"], [prompt], all_logits=True)
    torch.testing.assert_close(pre, ref[:11], **RUNNER_TOL)
    dec = r.forward(["a"], [cont[:1]])
    torch.testing.assert_close(dec, ref[11:12], **RUNNER_TOL)
    ver = r.forward(["a"], [cont[1:5]], all_logits=True)  # a K+1 = 4 row verification
    torch.testing.assert_close(ver, ref[12:16], **RUNNER_TOL)
    r.truncate("a", 11)
    # three branches from the prompt's prefix: the reference continuation and two others
    other = [_toks(3, 3), _toks(4, 3)]
    tree = r.tree_start(["a", "a", "a"], [11, 11, 8])
    branches = [cont[:3], other[0], other[1]]
    t1 = r.tree_forward(tree, [b[:1] for b in branches])
    t2 = r.tree_forward(tree, [b[1:] for b in branches])
    logits = torch.cat([t1, t2], dim=1)
    torch.testing.assert_close(logits[0], ref[11:14], **RUNNER_TOL)
    for i, (plen, b) in enumerate(zip([11, 8], other), start=1):
        torch.testing.assert_close(logits[i], _reference(r, prompt[:plen] + b)[plen:], **RUNNER_TOL)
    # a branch's K/V exported to a second runner equals committing it here
    delta = r.tree_export(tree, 0, 3)
    r.tree_commit(tree, 0, 3)
    r.add_sequence("b")
    r.forward(["b"], [prompt])
    r.append_kv("b", delta)
    after = cont[3:4]
    torch.testing.assert_close(r.forward(["b"], [after]), r.forward(["a"], [after]), **RUNNER_TOL)
    torch.testing.assert_close(r.forward(["a"], [cont[4:5]]), ref[15:16], **RUNNER_TOL)
    r.free_sequence("a")
    r.free_sequence("b")


@pytest.mark.parametrize("form", ["self", "separate"])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_draft_keeps_greedy_tokens(name: str, mode: str, form: str, zoo_tiny, monkeypatch) -> None:
    """A draft quantised at load — the target's own weights (``self:int4``) or
    a separate draft model (``int4:<spec>``): SD and SSD emit AR's tokens at T = 0."""
    target = str(zoo_tiny / "target")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [_toks(10, 7), _toks(11, 12), _toks(12, 4)]
    ar = LocalEngine(EngineConfig(target=target, threads_per_worker=1))
    expected = [r.token_ids for r in ar.generate(prompts, params)]
    ar.close()
    draft = f"self:{name}" if form == "self" else f"{name}:{zoo_tiny / 'draft'}"
    eng = LocalEngine(EngineConfig(target=target, draft=draft, spec=SpeculationConfig(mode=mode, k=3), threads_per_worker=1))
    try:
        assert [w.logic.runner.quantize for w in eng.workers.values()] == [None, name]
        got = eng.generate(prompts, params)
        assert [r.token_ids for r in got] == expected
        assert sum(sum(rec.accepted) for rec in eng.timeline) > 0  # the quantised draft's tokens were taken
    finally:
        eng.close()

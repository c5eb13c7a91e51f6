"""The graphed decode and verify steps (``saguaro_ray.workers.graphs``).

On the CPU the static path runs eagerly (``capture=False``): the same
buffers, buckets, padding rows and device-side mask a CUDA graph records. It
must give the ordinary forward's logits step after step — batches padded to
their bucket, contexts crossing blocks and a context bucket, rollbacks,
sliding windows — and leave the real sequences' KV as the ordinary forward
does (the next steps agree). On CUDA the GPU-marked test captures and
replays real graphs and holds them to the eager runner.
"""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_checkpoint

from saguaro_ray.workers.graphs import StepGraphs, bucket
from saguaro_ray.workers.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread, as each worker runs


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_models")
    if request.param == "mistral-window":
        return save_tiny_checkpoint(root, "mistral", seed=4, sliding_window=40, max_position_embeddings=1024)
    return save_tiny_checkpoint(root, "llama", seed=3, max_position_embeddings=1024)


def _ids(seed: int, n: int, vocab: int = 99) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _drive(runner: ModelRunner, steps: int = 6) -> list[torch.Tensor]:
    """Prefill three sequences (eager: long prompts), then alternate decode
    (1 token each) and verification (5 tokens each, rolled back to 2 kept),
    crossing block boundaries and, for sequence 0, the 256-key bucket."""
    seqs = [0, 1, 2]
    prompts = [_ids(10, 250), _ids(11, 30), _ids(12, 17)]
    for s, p in zip(seqs, prompts):
        runner.add_sequence(s)
    out = [runner.forward(seqs, prompts)]
    for i in range(steps):
        if i % 2 == 0:
            out.append(runner.forward(seqs, [_ids(100 + 10 * i + s, 1) for s in seqs]))
        else:
            start = [runner.seq_len(s) for s in seqs]
            out.append(runner.forward(seqs, [_ids(200 + 10 * i + s, 5) for s in seqs], all_logits=True))
            for s, n in zip(seqs, start):
                runner.truncate(s, n + 2)
    # one sequence alone (batch bucket 1), and two (bucket 2, no padding)
    out.append(runner.forward([1], [_ids(300, 4)], all_logits=True))
    out.append(runner.forward([0, 2], [_ids(301, 1), _ids(302, 1)]))
    return out


def test_bucket_is_the_next_power_of_two_times_the_smallest():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [bucket(n, 256) for n in (1, 256, 257, 600)] == [256, 256, 512, 1024]


def test_the_static_step_gives_the_forwards_logits(ckpt):
    eager = ModelRunner(str(ckpt))
    static = ModelRunner(str(ckpt))
    static.graphs = StepGraphs(static.model, static.kv, static.config.sliding_window, max_context=1024, capture=False)
    want, got = _drive(eager), _drive(static)
    assert static.graphs.replays >= 7  # every decode and verify step went through the static path
    assert len(static.graphs._graphs) >= 4  # several (batch, query, context) shapes, padding among them
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


def test_steps_it_cannot_serve_run_eagerly(ckpt):
    runner = ModelRunner(str(ckpt))
    graphs = StepGraphs(runner.model, runner.kv, None, max_batch=2, max_query=4, max_context=256, capture=False)
    assert graphs.fits([1, 1], [10, 300]) is False  # beyond the largest context bucket
    assert graphs.fits([1, 2], [10, 10]) is False  # ragged
    assert graphs.fits([5], [10]) is False  # beyond max_query
    assert graphs.fits([1, 1, 1], [10, 10, 10]) is False  # beyond max_batch
    assert graphs.fits([4, 4], [10, 256]) is True


def test_padding_rows_take_a_block_of_their_own(ckpt):
    runner = ModelRunner(str(ckpt), max_kv_tokens=64)
    free = runner.kv.free_blocks
    graphs = StepGraphs(runner.model, runner.kv, None, capture=False)
    assert runner.kv.free_blocks == free - 1
    runner.add_sequence(0)
    runner.forward([0], [_ids(1, 48)])  # every block but the pad block
    assert graphs.pad_block not in runner.kv.block_lists([0])[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_replay_the_eager_steps(ckpt, dtype):
    eager = ModelRunner(str(ckpt), device="cuda", dtype=dtype, attention_backend="torch", cuda_graphs=False)
    graphed = ModelRunner(str(ckpt), device="cuda", dtype=dtype, attention_backend="torch")
    assert eager.graphs is None and graphed.graphs is not None
    want, got = _drive(eager), _drive(graphed)
    assert graphed.graphs.captured >= 4 and graphed.graphs.replays >= 7
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.95


def _grow_trees(runner: ModelRunner) -> list[torch.Tensor]:
    """Two sequences (one past the 256-key bucket), then two builds of four
    one-token tree steps: five branches over both (3 in the bucket of 4 ...
    5 in the bucket of 8), then one branch alone."""
    runner.add_sequence(0)
    runner.add_sequence(1)
    runner.forward([0, 1], [_ids(20, 270), _ids(21, 40)])
    out = []
    for seqs, prefixes in (([0, 0, 1, 0, 1], [270, 265, 40, 200, 33]), ([1], [36])):
        tree = runner.tree_start(seqs, prefixes, depth=4)
        for j in range(4):
            out.append(runner.tree_forward(tree, [[_ids(400 + 10 * j + r, 1)[0]] for r in range(len(seqs))]))
        runner.tree_commit(tree, len(seqs) - 1, 2)  # the last branch's first two tokens join its sequence
        out.append(runner.forward([0, 1], [_ids(500, 1), _ids(501, 1)]))
    return out


def test_the_static_tree_step_gives_the_tree_forwards_logits(ckpt):
    eager = ModelRunner(str(ckpt))
    static = ModelRunner(str(ckpt))
    static.graphs = StepGraphs(static.model, static.kv, static.config.sliding_window, max_context=1024, capture=False)
    want, got = _grow_trees(eager), _grow_trees(static)
    assert any(k[0] == "tree" for k in static.graphs._graphs)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_the_eager_tree_steps(ckpt):
    eager = ModelRunner(str(ckpt), device="cuda", dtype=torch.float32, attention_backend="torch", cuda_graphs=False)
    graphed = ModelRunner(str(ckpt), device="cuda", dtype=torch.float32, attention_backend="torch")
    want, got = _grow_trees(eager), _grow_trees(graphed)
    assert any(k[0] == "tree" and g.graph is not None for k, g in graphed.graphs._graphs.items())
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)


def test_in_process_workers_sharing_turns_never_run_at_once():
    """On CUDA the in-process engine's workers take turns (a graph recorded in
    one thread must not see another thread's kernels): two workers' calls,
    submitted together, do not overlap; without turns they do."""
    import threading
    import time

    from saguaro_ray.engine.transport import InProcessWorker

    class Slow:
        def __init__(self, spans):
            self.spans = spans

        def work(self):
            t0 = time.perf_counter()
            time.sleep(0.05)
            self.spans.append((t0, time.perf_counter()))

    def overlap(turns):
        spans: list = []
        a, b = InProcessWorker("a", Slow(spans), turns=turns), InProcessWorker("b", Slow(spans), turns=turns)
        try:
            for f in [a.submit("work"), b.submit("work")]:
                f.result()
        finally:
            a.close()
            b.close()
        (s1, e1), (s2, e2) = sorted(spans)
        return s2 < e1

    assert overlap(None) is True
    assert overlap(threading.Lock()) is False

"""CUDA graphs of the runner's uniform steps: decode (1 token per sequence),
verification (K+1 tokens per sequence) and the one-token tree step of an SSD
build.

A small model's step on a GPU is launch-bound: a 24-layer decoder issues a
few hundred small kernels, each costing more to launch from Python than to
run. A CUDA graph records them once and replays them with one launch. What a
graph replays is fixed — shapes and the addresses it reads — so a step runs
through *static buffers* of a fixed size, and everything that varies from
step to step is data in those buffers:

* one packed int64 buffer per graph holds the step's token ids, positions,
  the cache slots the new K/V go to, each sequence's context length and its
  block table; the host fills it with one pinned, non-blocking copy;
* the keys a sequence attends to are gathered through its block table up to
  a fixed *context bucket* L (a power of two); the mask (key j visible to
  query i of sequence b iff j <= its cache index, within the sliding window)
  is computed on the device from the context lengths, inside the graph;
* a batch of B sequences runs in the graph of the next *batch bucket*
  (1, 2, 4, 8, 16, 32, ...); padding rows read and write only a reserved pad
  block of the KV pool, and attend to it alone, so they touch nothing real.

A tree step (N branch rows, one new token each) is graphed the same way:
rows padded to a power-of-two bucket, each row's prefix gathered through its
sequence's block table up to a context bucket, its scratch row read whole,
and the suffix length — where the new token's K/V go — is data, not shape
(``tree_attention.plan_static_tree``). Measured on the first GPU run (H200,
Qwen2.5-Coder sizes, bf16): an eager tree step cost 25-32 ms, almost all of
it launching kernels, against 2.5-3.7 ms for a graphed decode.

Graphs are keyed by (family, batch bucket, query length, context bucket) and captured
the first time a step of that shape comes (a warm-up run on a side stream,
then the capture; both compute the real step, so the replay that follows
rewrites the same K/V). All graphs share one memory pool, as nano-vllm's and
the SSD reference engine's do (they are never replayed at once).

Without CUDA (``capture=False``) the same static path runs eagerly: the CPU
tests hold it to the runner's ordinary forward, so the first GPU run has only
the capture itself left to validate (``tests/test_parity.py``'s GPU test and
``python -m saguaro_ray.jobs.gpu_check`` compare graphed with eager logits).
Prefill, ragged batches, tree steps and anything beyond the largest bucket run
eagerly.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from saguaro_ray.algorithms.tensors import upload_into
from saguaro_ray.kernels.attention import TorchBackend
from saguaro_ray.kernels.paged_attention import PagedPlan
from saguaro_ray.kernels.tree_attention import TreePlan, plan_static_tree
from saguaro_ray.workers.decoder import AttentionStep, Decoder
from saguaro_ray.workers.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 256
# One capture at a time in a process: ``torch.cuda.graph`` synchronises the
# device before it records, and synchronising a stream another thread is
# recording on fails both captures (seen on the first GPU run: the in-process
# engine's target and draft threads captured their first steps at once).
_CAPTURE_LOCK = threading.Lock()


def bucket(n: int, smallest: int = 1) -> int:
    """The smallest power of two times ``smallest`` that holds ``n``."""
    b = smallest
    while b < n:
        b *= 2
    return b


@dataclass
class _Graph:
    """One captured shape: its packed input buffer and output (static addresses)."""

    batch: int  # sequences, or tree rows (bucket)
    query: int  # tokens per sequence (1 for a tree step)
    context: int  # keys per sequence (bucket)
    inputs: torch.Tensor  # int64, packed as the family's _pack writes it
    body: Callable[["_Graph"], torch.Tensor]  # the step, reading only ``inputs`` (and the caches)
    logits: torch.Tensor | None = None  # [rows, V] fp32, set by the run that fills it
    graph: "torch.cuda.CUDAGraph | None" = None


class StepGraphs:
    """The graphed (or, without CUDA, static-eager) decode and verify steps of one runner."""

    def __init__(
        self,
        model: Decoder,
        kv: PagedKVCache,
        window: int | None,
        *,
        max_batch: int = 32,
        max_query: int = 9,
        max_context: int = 4096,
        capture: bool = True,
    ) -> None:
        if max_query > kv.block_size:
            raise ValueError(f"max_query {max_query} must not exceed the block size {kv.block_size} (padding rows live in one block)")
        self.model, self.kv, self.window = model, kv, window
        self.max_batch, self.max_query = max_batch, max_query
        self.block_size = kv.block_size
        self.max_context = bucket(max_context, bucket(MIN_CONTEXT_BUCKET, self.block_size))
        self.capture = capture
        self.device = kv.layers[0][0].device
        self.pad_block = kv.reserve_block()  # padding rows write here, and read nothing else
        self.backend = TorchBackend()  # the static plan is a masked gather, torch's paged form
        self._graphs: dict[tuple[str, int, int, int], _Graph] = {}
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # what tree graphs recorded
        self.max_tree_rows = 64
        self._pool = None
        self.captured = 0  # graphs captured so far
        self.capture_error: str | None = None  # why capturing failed (then every step runs eagerly)
        self.replays = 0  # steps served by a graph (or by the static path without CUDA)

    def fits(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> bool:
        """Whether a step can run here: one query length up to ``max_query``,
        at most ``max_batch`` sequences, every context within the largest bucket
        (and no capture has failed)."""
        n = query_lens[0]
        return (
            self.capture_error is None
            and n <= self.max_query
            and len(query_lens) <= self.max_batch
            and all(q == n for q in query_lens)
            and max(context_lens) <= self.max_context
        )

    def run(
        self,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        slots: Sequence[int],
        block_lists: Sequence[list[int]],
        context_lens: Sequence[int],
    ) -> torch.Tensor:
        """fp32 logits ``[B * n, V]`` of every new token (a copy: the next replay reuses the buffer)."""
        b, n = len(tokens), len(tokens[0])
        g = self._graph(("paged", bucket(b), n, self._context_bucket(max(context_lens))), self._body)
        upload_into(g.inputs, self._pack(g, tokens, positions, slots, block_lists, context_lens))
        return self._launch(g, b * n)

    def fits_tree(self, branches: int, prefix_lens: Sequence[int], scratch_rows: int) -> bool:
        """Whether a one-token tree step can run here: its branch bucket within
        the scratch's rows (padding rows write scratch rows past the real ones)
        and every prefix within the largest context bucket."""
        return (
            self.capture_error is None
            and bucket(branches) <= min(scratch_rows, self.max_tree_rows)
            and max(prefix_lens) <= self.max_context
        )

    def run_tree(
        self,
        tokens: torch.Tensor,
        prefix_lens: Sequence[int],
        block_lists: Sequence[list[int]],
        suffix_len: int,
        scratch: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """fp32 logits ``[N, V]`` of one new token per branch row: row r
        continues ``block_lists[r]``'s first ``prefix_lens[r]`` keys and its
        scratch row's first ``suffix_len`` entries (``tokens [N, 1]``, on the device)."""
        if scratch is not self._scratch:  # the runner grew its scratch: graphs recorded the old one
            self._graphs = {k: g for k, g in self._graphs.items() if k[0] != "tree"}
            self._scratch = scratch
        n = len(prefix_lens)
        g = self._graph(("tree", bucket(n), 1, self._context_bucket(max(prefix_lens))), self._tree_body)
        pad = g.batch - n
        upload_into(g.inputs[g.batch :], list(prefix_lens) + [1] * pad + [suffix_len] + self._tables(g, block_lists))
        g.inputs[:n].copy_(tokens.reshape(-1))
        return self._launch(g, n)

    # ------------------------------------------------------------ internals
    def _context_bucket(self, n: int) -> int:
        return bucket(n, bucket(MIN_CONTEXT_BUCKET, self.block_size))

    def _graph(self, key: tuple[str, int, int, int], body: Callable[[_Graph], torch.Tensor]) -> _Graph:
        g = self._graphs.get(key)
        if g is None:
            family, b, n, ctx = key
            width = ctx // self.block_size
            size = (3 * b * n + b + b * width) if family == "paged" else (2 * b + 1 + b * width)
            g = self._graphs[key] = _Graph(b, n, ctx, torch.zeros(size, dtype=torch.long, device=self.device), body)
        return g

    def _launch(self, g: _Graph, rows: int) -> torch.Tensor:
        """Replay ``g`` (capturing it the first time; eagerly without CUDA) and
        copy out its first ``rows`` logit rows."""
        if g.graph is not None:
            g.graph.replay()
        elif self.capture:
            self._capture(g)
        else:
            g.logits = g.body(g)
        self.replays += 1
        assert g.logits is not None
        return g.logits[:rows].clone()

    def _pack(
        self,
        g: _Graph,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        slots: Sequence[int],
        block_lists: Sequence[list[int]],
        context_lens: Sequence[int],
    ) -> list[int]:
        """The packed inputs: ids | positions | slots | context lengths | block
        tables, padded to the graph's batch and context buckets."""
        b, n, bs = len(tokens), g.query, self.block_size
        pad_rows = g.batch - b
        pad_slots = [self.pad_block * bs + j for j in range(n)]
        ids = [t for seq in tokens for t in seq] + [0] * (pad_rows * n)
        pos = [p for seq in positions for p in seq] + list(range(n)) * pad_rows
        slot = list(slots) + pad_slots * pad_rows
        lens = list(context_lens) + [n] * pad_rows
        return ids + pos + slot + lens + self._tables(g, block_lists)

    def _tables(self, g: _Graph, block_lists: Sequence[list[int]]) -> list[int]:
        """The rows' block tables, flat: each padded to the context bucket's
        width, then whole rows for the batch bucket's padding — every padding
        entry the pad block, which holds nothing real."""
        width = g.context // self.block_size
        table: list[int] = []
        for blocks in block_lists:
            table.extend(blocks[:width])
            table.extend([self.pad_block] * (width - min(len(blocks), width)))
        table.extend([self.pad_block] * (width * (g.batch - len(block_lists))))
        return table

    def _body(self, g: _Graph) -> torch.Tensor:
        """The step, reading only ``g.inputs``: what the graph records."""
        b, n, ctx, bs = g.batch, g.query, g.context, self.block_size
        t = b * n
        ids, pos, slot = g.inputs[:t], g.inputs[t : 2 * t], g.inputs[2 * t : 3 * t]
        lens = g.inputs[3 * t : 3 * t + b]
        table = g.inputs[3 * t + b :].view(b, ctx // bs)
        dev = g.inputs.device
        kv_slots = (table.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).view(b, ctx)
        q_index = (lens - n).unsqueeze(1) + torch.arange(n, device=dev)  # [B, n] cache index of each query
        key = torch.arange(ctx, device=dev)
        allowed = key.view(1, 1, ctx) <= q_index.unsqueeze(-1)  # [B, n, L]
        if self.window is not None:
            allowed &= (q_index.unsqueeze(-1) - key) < self.window
        plan = PagedPlan(kv_slots=kv_slots, kv_range=None, mask=allowed.unsqueeze(1), q_index=None, q_valid=None, qmax=n)
        step = AttentionStep(kind="paged", backend=self.backend, plan=plan, slot_mapping=slot)
        hidden = self.model.hidden_states(ids, pos, self.kv.layers, step)
        return self.model.logits(hidden).float()

    def _tree_body(self, g: _Graph) -> torch.Tensor:
        """A one-token tree step, reading only ``g.inputs`` (ids | prefix
        lengths | suffix length | block tables) and the scratch it recorded."""
        b, bs = g.batch, self.block_size
        ids, prefix = g.inputs[:b], g.inputs[b : 2 * b]
        suffix = g.inputs[2 * b : 2 * b + 1]
        table = g.inputs[2 * b + 1 :].view(b, g.context // bs)
        assert self._scratch is not None
        cap = self._scratch[0][0].shape[1]
        rows = torch.arange(b, device=ids.device)
        plan = plan_static_tree(table, prefix, suffix, bs, cap, self.window)
        step = AttentionStep(
            kind="tree", backend=self.backend, plan=TreePlan(static=plan), scratch_slots=rows * cap + suffix, num_branches=b, n_new=1,
        )
        hidden = self.model.hidden_states(ids, prefix + suffix, self.kv.layers, step, self._scratch)
        return self.model.logits(hidden).float()

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream (cuBLAS workspaces, lazy inits), then
        record the step; both compute the real step, so its K/V are written
        and its logits are there before the first replay.

        The capture is thread-local: in process every worker runs on its own
        thread (``engine/transport.py``), and another worker's kernels or
        allocations while this one records must not invalidate the recording
        (they would, in CUDA's default global mode). A capture that fails
        anyway turns graphs off for this runner — the step and every later one
        run eagerly, and ``capture_error`` says why (``gpu_check`` fails on it)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            g.logits = g.body(g)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = g.body(g)
        except Exception as e:  # noqa: BLE001 — keep serving, eagerly, and say why
            self.capture_error = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture failed (batch %d, query %d, context %d); this runner runs eagerly from now on: %s",
                        g.batch, g.query, g.context, self.capture_error)
            return  # the warm-up computed this step's logits and K/V
        graph.replay()  # recording ran nothing: this step's logits come from the replay (its K/V writes repeat the warm-up's)
        g.logits, g.graph = logits, graph
        self.captured += 1
        log.debug("captured the step graph for batch %d, query %d, context %d", g.batch, g.query, g.context)

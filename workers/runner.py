"""The model runner: a decoder plus its paged KV cache and tree scratch.

This is the one object every worker (target, draft, qualifier) drives:

* :meth:`ModelRunner.forward` — a ragged batch where each sequence brings any
  number of new tokens (prefill, AR decode with 1, verification with K+1);
  their K/V are appended to the sequence's cache and logits come back for the
  last token of each sequence or for every token.
* :meth:`ModelRunner.truncate` — rollback after a rejection.
* :meth:`ModelRunner.tree_start` / :meth:`ModelRunner.tree_forward` — the
  shared-prefix tree decode used to pre-compute speculations: N branch rows,
  each continuing one sequence's cached prefix up to its own length limit,
  with per-branch suffix K/V in a scratch buffer; nothing of the prefix is
  copied. :meth:`ModelRunner.tree_commit` moves a branch's suffix K/V into
  the sequence's cache (the "KV delta" of an accepted speculation), and
  :meth:`ModelRunner.tree_export` / :meth:`ModelRunner.append_kv` carry the
  same delta between processes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from saguaro_ray.algorithms.tensors import tensor_like
from saguaro_ray.errors import ConfigError, OutOfKVBlocksError, PromptTooLongError
from saguaro_ray.kernels.attention import FlashAttnBackend, PagedBatch, TreeBatch, select_backend
from saguaro_ray.kernels.linear import linear_kernel, pack_linears
from saguaro_ray.kernels.quantized import SCHEMES, quantize_decoder, scheme
from saguaro_ray.kernels.subset_head import SubsetHead, check_draft_vocab, subset_ids
from saguaro_ray.runtime.process_memory import trim
from saguaro_ray.workers.checkpoint import Checkpoint, load_decoder, open_checkpoint
from saguaro_ray.workers.decoder import AttentionStep
from saguaro_ray.workers.graphs import StepGraphs
from saguaro_ray.workers.kv_cache import PagedKVCache
from saguaro_ray.workers.model_config import parse_dtype
from saguaro_ray.workers.tensor_parallel import TPContext

log = logging.getLogger(__name__)

SeqId = Hashable


@dataclass
class TreeState:
    """A live tree decode: which sequence and prefix length each branch continues."""

    seq_ids: list[SeqId]  # distinct prefix sequences
    branch_seq: list[int]  # per branch: index into seq_ids
    prefix_lens: list[int]  # per branch: cached tokens of its sequence it attends to
    suffix_len: int = 0  # tokens already in every branch's scratch

    @property
    def num_branches(self) -> int:
        return len(self.branch_seq)


class ModelRunner:
    """Runs one Llama-family checkpoint with a paged KV cache on one device."""

    def __init__(
        self,
        model: str | os.PathLike | Checkpoint,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        block_size: int | None = None,
        max_kv_tokens: int | None = None,
        max_tree_branches: int = 64,
        max_tree_depth: int = 16,
        attention_backend: str | None = None,
        cuda_graphs: bool = True,
        tp: TPContext | None = None,
        quantize: str | None = None,
        head_vocab: int | None = None,
    ) -> None:
        """``tp``: this runner is one rank of a tensor-parallel group and
        loads and runs only its slice (see :mod:`saguaro_ray.workers.tensor_parallel`).
        ``quantize``: ``None`` or a scheme of :data:`saguaro_ray.kernels.quantized.SCHEMES`
        (``"int8"``, ``"int4"``): the linears and LM head are quantised at
        load (weight-only; embedding rows stay exact) — a different, cheaper
        model, e.g. the target's self-draft. The linear kernels follow
        ``SAGUARO_LINEAR_KERNEL`` (see :mod:`saguaro_ray.kernels.linear`).
        ``head_vocab``: a draft's reduced-vocabulary LM head over that many ids
        (``EngineConfig.draft_vocab``; see :mod:`saguaro_ray.kernels.subset_head`):
        logits are -inf at every other id; ``None`` or the vocabulary size or
        more: the full head.
        ``cuda_graphs``: on CUDA, decode and verification steps replay CUDA
        graphs (:mod:`saguaro_ray.workers.graphs`); a quantised, sharded or
        reduced-head runner, and any CPU runner, runs eagerly."""
        check_draft_vocab(head_vocab)
        if quantize is not None:
            scheme(quantize)  # refuse an unknown name before loading anything
        if tp is not None and (quantize is not None or head_vocab is not None):
            raise ConfigError("quantize and a reduced-vocabulary head (draft_vocab) are not supported on a tensor-parallel runner")
        kernel = linear_kernel()
        if kernel == "int" and quantize is None:
            raise ConfigError(f"SAGUARO_LINEAR_KERNEL=int needs a quantised model (quantize= one of {', '.join(SCHEMES)})")
        self.device = torch.device(device)
        self.quantize = quantize
        self.checkpoint = model if isinstance(model, Checkpoint) else open_checkpoint(model)
        self.config = self.checkpoint.config
        self.dtype = parse_dtype(dtype, default=torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.backend = select_backend(attention_backend, self.device, self.dtype)
        if block_size is None:
            block_size = FlashAttnBackend.required_block_size if isinstance(self.backend, FlashAttnBackend) else 16
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.model = load_decoder(self.checkpoint, self.device, self.dtype, tp)
        self.head_ids: torch.Tensor | None = None  # the ids a reduced head computes (None: all)
        if head_vocab is not None and head_vocab < self.config.vocab_size:
            # sliced before quantising or packing, so the subset head gets the full head's kernels
            self.head_ids = subset_ids(self.config.vocab_size, head_vocab, self._special_ids())
            self.model.lm_head = SubsetHead(self.model.lm_head, self.head_ids)
        self._head_input: torch.Tensor | None = None  # hidden rows of the latest logits (a reduced head's fallback)
        self.kv_heads = self.model.cfg.num_kv_heads  # this rank's KV heads (all of them without tp)
        # every projection and the LM head: quantised, or (CPU fp32/bf16) pre-packed oneDNN weights
        if quantize is not None:
            quantize_decoder(self.model, quantize, self.dtype, kernel)
        else:
            pack_linears(self.model, self.device, self.dtype, kernel, release_dense=True)
        # what loading, casting, quantising and packing allocated and freed, glibc would hold for
        # good (the coder pair's three workers in one process: 1.2 GB beside the 9.8 GB kept)
        trim()
        cfg = self.config
        if max_kv_tokens is None:
            max_kv_tokens = 8 * min(cfg.max_position_embeddings, 4096)
        num_blocks = -(-max_kv_tokens // block_size)
        self.kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, self.kv_heads, cfg.head_dim, self.dtype, self.device)
        sshape = (max_tree_branches, max_tree_depth, self.kv_heads, cfg.head_dim)
        self._scratch = [
            (torch.zeros(sshape, dtype=self.dtype, device=self.device), torch.zeros(sshape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.graphs: StepGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and quantize is None and tp is None and self.head_ids is None:
            self.graphs = StepGraphs(self.model, self.kv, cfg.sliding_window, max_context=min(self.max_context, max_kv_tokens))

    # ---------------------------------------------------------------- facts
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def _special_ids(self) -> set[int]:
        """Ids a reduced head must always cover: the config's EOS ids and the
        tokenizer's special and added special tokens."""
        from saguaro_ray.tokenizer import load_tokenizer

        tok = load_tokenizer(self.checkpoint.path)
        added = getattr(tok, "added_tokens_decoder", {})
        return set(self.eos_token_ids) | set(tok.all_special_ids) | {i for i, t in added.items() if t.special}

    # ------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: SeqId) -> None:
        self.kv.add(seq_id)

    def free_sequence(self, seq_id: SeqId) -> None:
        self.kv.free(seq_id)

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self.kv.seqs

    def seq_len(self, seq_id: SeqId) -> int:
        return self.kv.length(seq_id)

    def truncate(self, seq_id: SeqId, length: int) -> None:
        self.kv.truncate(seq_id, length)

    # -------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        seq_ids: Sequence[SeqId],
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]] | None = None,
        all_logits: bool = False,
        num_logits: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens[b]`` to sequence ``seq_ids[b]`` and run the model.

        ``positions`` default to the cache indices the tokens land at. Returns
        fp32 logits for the last ``num_logits[b]`` new tokens of each sequence
        (default 1; every new token when ``all_logits``), flat in batch order:
        ``[sum(num_logits), V]``. Only those rows go through the LM head.
        """
        if len(seq_ids) != len(tokens) or not seq_ids:
            raise ValueError("forward needs one non-empty token list per sequence")
        qlens = [len(t) for t in tokens]
        if min(qlens) == 0:
            raise ValueError("every sequence in a forward must bring at least one token")
        wanted = list(qlens) if all_logits else ([1] * len(qlens) if num_logits is None else list(num_logits))
        if len(wanted) != len(qlens) or any(not 1 <= w <= n for w, n in zip(wanted, qlens)):
            raise ValueError(f"num_logits {wanted} must ask for 1..n_b rows of each sequence (n_b = {qlens})")
        self._check_capacity(seq_ids, qlens)
        dev = self.device
        starts = [self.kv.length(s) for s in seq_ids]
        slots: list[int] = []
        for s, n in zip(seq_ids, qlens):
            slots.extend(self.kv.reserve(s, n))
        context_lens = [s + n for s, n in zip(starts, qlens)]
        if self.graphs is not None and self.graphs.fits(qlens, context_lens):
            pos_lists = positions if positions is not None else [range(s, s + n) for s, n in zip(starts, qlens)]
            logits = self.graphs.run(tokens, pos_lists, slots, self.kv.block_lists(seq_ids), context_lens)
            return self._wanted_rows(logits, qlens, wanted)
        if positions is not None:
            pos = torch.tensor([p for seq in positions for p in seq], dtype=torch.long, device=dev)
        elif len(starts) == 1:
            pos = torch.arange(starts[0], starts[0] + qlens[0], device=dev)
        else:
            pos = torch.tensor([p for s, n in zip(starts, qlens) for p in range(s, s + n)], dtype=torch.long, device=dev)
        lists = self.kv.block_lists(seq_ids)
        batch = PagedBatch(
            block_tables=self.kv.table_tensor(lists, dev),
            context_lens=context_lens,
            query_lens=qlens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_size=self.kv.block_size,
            block_lists=lists,
        )
        step = AttentionStep(
            kind="paged",
            backend=self.backend,
            plan=self.backend.plan_paged(batch, self.config.sliding_window, dev),
            slot_mapping=batch.slot_mapping,
        )
        ids = torch.tensor(tokens[0] if len(tokens) == 1 else [t for seq in tokens for t in seq], dtype=torch.long, device=dev)
        hidden = self.model.hidden_states(ids, pos, self.kv.layers, step)
        return self._logits(self._wanted_rows(hidden, qlens, wanted))

    @staticmethod
    def _wanted_rows(rows: torch.Tensor, qlens: Sequence[int], wanted: Sequence[int]) -> torch.Tensor:
        """The last ``wanted[b]`` of each sequence's ``qlens[b]`` rows (flat, in batch order)."""
        if list(wanted) == list(qlens):
            return rows
        if len(qlens) == 1:
            return rows[qlens[0] - wanted[0] :]
        index: list[int] = []
        end = 0
        for n, w in zip(qlens, wanted):
            end += n
            index.extend(range(end - w, end))
        return rows[tensor_like(rows, index)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_ids is not None:
            self._head_input = hidden
        return self.model.logits(hidden).float()

    @torch.inference_mode()
    def full_head_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 full-vocabulary logits of ``rows`` (flat indices) of the
        latest :meth:`forward` or :meth:`tree_forward` logits, through the full
        head a reduced-vocabulary runner keeps (for rows its subset cannot
        serve)."""
        if self.head_ids is None or self._head_input is None:
            raise ValueError("full_head_logits needs a reduced-vocabulary head and a forward before it")
        return self.model.lm_head.full_logits(self._head_input[rows]).float()

    def _check_capacity(self, seq_ids: Sequence[SeqId], qlens: Sequence[int]) -> None:
        """Refuse a forward that would overflow the context or the block pool
        *before* touching any sequence, so a failure loses nothing."""
        for s, n in zip(seq_ids, qlens):
            if self.kv.length(s) + n > self.max_context:
                raise PromptTooLongError(
                    f"sequence {s!r} would reach {self.kv.length(s) + n} tokens, beyond the "
                    f"model's context window of {self.max_context}"
                )
        need = sum(self.kv.blocks_needed(s, n) for s, n in zip(seq_ids, qlens))
        if need > self.kv.free_blocks:
            raise OutOfKVBlocksError(
                f"KV cache full: this step needs {need} blocks, {self.kv.free_blocks} free of {self.kv.num_blocks}"
            )

    # ------------------------------------------------------------ tree decode
    def tree_start(self, branch_seqs: Sequence[SeqId], prefix_lens: Sequence[int], depth: int | None = None) -> TreeState:
        """Open a tree decode: branch r continues ``branch_seqs[r]`` after its
        first ``prefix_lens[r]`` cached tokens (that prefix must be cached).
        ``depth`` (suffix tokens per branch) grows the scratch buffer if needed."""
        n = len(branch_seqs)
        if n == 0:
            raise ValueError("tree decode needs at least one branch")
        self._ensure_scratch(n, depth or self._scratch[0][0].shape[1])
        distinct: list[SeqId] = []
        index: dict[SeqId, int] = {}
        branch_seq = []
        for s, plen in zip(branch_seqs, prefix_lens):
            if not 0 < plen <= self.kv.length(s):
                raise ValueError(f"branch prefix length {plen} outside sequence {s!r} of length {self.kv.length(s)}")
            if s not in index:
                index[s] = len(distinct)
                distinct.append(s)
            branch_seq.append(index[s])
        return TreeState(seq_ids=distinct, branch_seq=branch_seq, prefix_lens=list(prefix_lens))

    def _ensure_scratch(self, branches: int, depth: int) -> None:
        """Grow the per-branch scratch K/V (never shrinks; contents are per tree)."""
        cap_b, cap_d = self._scratch[0][0].shape[:2]
        if branches <= cap_b and depth <= cap_d:
            return
        cfg = self.config
        shape = (max(branches, cap_b), max(depth, cap_d), self.kv_heads, cfg.head_dim)
        self._scratch = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]

    @torch.inference_mode()
    def tree_forward(self, tree: TreeState, tokens: torch.Tensor | Sequence[Sequence[int]], positions: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``tokens [N, n]`` (n new tokens per branch) and return fp32 logits ``[N, n, V]``.

        Default positions continue each branch: prefix_len + suffix_len + j.
        """
        dev = self.device
        tok = torch.as_tensor(tokens, dtype=torch.long, device=dev)
        nb, n_new = tok.shape
        if nb != tree.num_branches:
            raise ValueError(f"tree has {tree.num_branches} branches, got tokens for {nb}")
        depth_cap = self._scratch[0][0].shape[1]
        if tree.suffix_len + n_new > depth_cap:
            raise ValueError(f"tree depth {tree.suffix_len + n_new} exceeds the scratch capacity {depth_cap}")
        if self.graphs is not None and n_new == 1 and positions is None and self.graphs.fits_tree(nb, tree.prefix_lens, self._scratch[0][0].shape[0]):
            lists = self.kv.block_lists(tree.seq_ids)
            logits = self.graphs.run_tree(tok, tree.prefix_lens, [lists[s] for s in tree.branch_seq], tree.suffix_len, self._scratch)
            tree.suffix_len += 1
            return logits.view(nb, 1, -1)
        if positions is None:
            base = torch.tensor(tree.prefix_lens, device=dev).unsqueeze(1) + tree.suffix_len
            positions = base + torch.arange(n_new, device=dev).unsqueeze(0)
        lists = self.kv.block_lists(tree.seq_ids)
        batch = TreeBatch(
            block_tables=self.kv.table_tensor(lists, dev),
            block_lists=lists,
            branch_seq=tree.branch_seq,
            prefix_lens=tree.prefix_lens,
            suffix_len=tree.suffix_len,
            n_new=n_new,
            block_size=self.kv.block_size,
        )
        step = AttentionStep(
            kind="tree",
            backend=self.backend,
            plan=self.backend.plan_tree(batch, self.config.sliding_window, dev),
            num_branches=nb,
            suffix_len=tree.suffix_len,
            n_new=n_new,
        )
        hidden = self.model.hidden_states(tok.reshape(-1), positions.reshape(-1).to(dev), self.kv.layers, step, self._scratch)
        tree.suffix_len += n_new
        return self._logits(hidden).view(nb, n_new, -1)

    def tree_export(self, tree: TreeState, branch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n`` suffix K/V rows of a branch, per layer (copies)."""
        if not 0 <= n <= tree.suffix_len:
            raise ValueError(f"branch has {tree.suffix_len} suffix tokens, asked for {n}")
        return [(ks[branch, :n].clone(), vs[branch, :n].clone()) for ks, vs in self._scratch]

    def tree_commit(self, tree: TreeState, branch: int, n: int) -> None:
        """Make a branch's first ``n`` suffix tokens part of its sequence:
        truncate the sequence to the branch's prefix and append the K/V."""
        seq = tree.seq_ids[tree.branch_seq[branch]]
        if not 0 <= n <= tree.suffix_len:
            raise ValueError(f"branch has {tree.suffix_len} suffix tokens, asked for {n}")
        # check capacity for the committed state *before* truncating, so a
        # failing commit leaves the sequence as it was
        plen = tree.prefix_lens[branch]
        if plen + n > self.max_context:
            raise PromptTooLongError(
                f"sequence {seq!r} would reach {plen + n} tokens, beyond the model's context window of {self.max_context}"
            )
        bs, held = self.kv.block_size, len(self.kv.seqs[seq].blocks)
        keep = min(held, -(-plen // bs))
        need = max(0, -(-(plen + n) // bs) - keep)
        if need > self.kv.free_blocks + held - keep:
            raise OutOfKVBlocksError(
                f"KV cache full: committing {n} tokens needs {need} blocks, "
                f"{self.kv.free_blocks + held - keep} free of {self.kv.num_blocks}"
            )
        self.truncate(seq, plen)
        self.append_kv(seq, [(ks[branch, :n], vs[branch, :n]) for ks, vs in self._scratch])

    def append_kv(self, seq_id: SeqId, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append precomputed K/V rows (one ``[n, Hkv, D]`` pair per layer) to a sequence."""
        if len(kv) != len(self.kv.layers):
            raise ValueError(f"KV delta has {len(kv)} layers, model has {len(self.kv.layers)}")
        n = kv[0][0].shape[0]
        if n == 0:
            return
        self._check_capacity([seq_id], [n])
        slots = torch.tensor(self.kv.reserve(seq_id, n), dtype=torch.long, device=self.device)
        cfg = self.config
        for (kc, vc), (k, v) in zip(self.kv.layers, kv):
            kc.view(-1, self.kv_heads, cfg.head_dim).index_copy_(0, slots, k.to(self.device, self.dtype))
            vc.view(-1, self.kv_heads, cfg.head_dim).index_copy_(0, slots, v.to(self.device, self.dtype))

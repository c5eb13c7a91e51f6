"""Turning logits into the processed target law p, and drawing from a law.

The processed distribution is what every exactness statement is about:
temperature, then top-k (ties to the lowest token id), then top-p over what is
left. Greedy rows (temperature 0) become a one-hot on the argmax (lowest id
among ties) so greedy and stochastic verification share one code path.

Every sampled token is checked by the drafter-invariant rule, which needs
noise that the target, the qualifier and every draft compute alike for the
same token: :func:`race_noise` hashes (seed, output position, token id) with a
counter-based generator on the logits' device, and a token is the winner of
an exponential race (:func:`race_token`, the Gumbel-max trick).

The lossy fuzzy PyramidSD stages keep speculative sampling's accept test and
residual draw, with inverse-CDF draws (:func:`sample_from`) from uniforms of a
per-position ``torch.Generator`` kept on the CPU (:func:`position_uniforms`),
so a seed gives the same uniforms on any device.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch


def argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension; ties resolve to the lowest index."""
    # torch.argmax returns the first maximal index, i.e. the lowest token id.
    return torch.argmax(x, dim=-1)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int] | None = None,
    top_p: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Processed next-token law for each row of ``logits [..., V]``.

    ``temperature``, ``top_k`` and ``top_p`` have one value per row (the leading
    dims flattened). Returns fp32 probabilities of the same shape.
    """
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).float()
    rows, vocab = x.shape
    dev = x.device
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).reshape(-1).expand(rows)
    greedy = temp == 0
    n_greedy = int(greedy.sum())
    if n_greedy == rows:  # all greedy: one-hot rows, no gathers
        return torch.zeros_like(x).scatter_(-1, argmax_lowest(x).unsqueeze(-1), 1.0).view(shape)
    k = None if top_k is None else torch.as_tensor(top_k, device=dev).reshape(-1).expand(rows)
    p = None if top_p is None else torch.as_tensor(top_p, dtype=torch.float32, device=dev).reshape(-1).expand(rows)
    if n_greedy == 0:
        return _filtered_softmax(x / temp.unsqueeze(-1), k, p).view(shape)
    out = torch.empty_like(x)
    g = greedy.nonzero(as_tuple=True)[0]
    out[g] = torch.zeros(len(g), vocab, dtype=out.dtype, device=dev).scatter_(-1, argmax_lowest(x[g]).unsqueeze(-1), 1.0)
    s = (~greedy).nonzero(as_tuple=True)[0]
    out[s] = _filtered_softmax(x[s] / temp[s].unsqueeze(-1), None if k is None else k[s], None if p is None else p[s])
    return out.view(shape)


def _filtered_softmax(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    needs_k = top_k is not None and bool((top_k > 0).any())
    needs_p = top_p is not None and bool((top_p < 1).any())
    if not (needs_k or needs_p):
        return torch.softmax(z, dim=-1)
    vocab = z.shape[-1]
    # stable descending sort: among equal logits the lower token id ranks first
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=z.device).unsqueeze(0)
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    if needs_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
        keep &= rank < k
    sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    if needs_p:
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < top_p.unsqueeze(-1)
        sorted_z = sorted_z.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    return torch.softmax(filtered, dim=-1)


def uniforms(generators: Sequence[torch.Generator], n: int = 1) -> torch.Tensor:
    """``n`` U[0, 1) draws per sequence from its own generator: ``[B, n]``."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of ``probs [B, V]`` with uniforms ``u [B]``.

    Rows need not be normalised. Zero-probability tokens are never returned.
    """
    p = probs.double()
    cdf = torch.cumsum(p, dim=-1)
    target = (u.to(cdf.device).reshape(-1, 1) * cdf[:, -1:]).clamp_max(cdf[:, -1:])
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    idx = idx.clamp_max(p.shape[-1] - 1)
    # guard against landing on a zero-mass token through rounding at the top end
    bad = p.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if bool(bad.any()):
        last_nonzero = (p > 0).cumsum(-1).argmax(-1)
        idx = torch.where(bad, last_nonzero, idx)
    return idx


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


# Independent random streams per purpose: a fuzzy stage's accept test must never
# reuse the noise its proposal was drawn with (the race noise, or the qualifier's
# uniforms), or the test would be correlated with the proposal.
STREAM_TARGET = 0
STREAM_QUALIFIER = 2
# The drafter-invariant rule's public noise: one stream that every worker kind
# (target, qualifier, draft) reads, because the rule *needs* the proposal and the
# verifier to share their noise (see :func:`race_token`).
STREAM_RACE = 3


def position_generator(seed: int, position: int, stream: int = STREAM_TARGET) -> torch.Generator:
    """The random stream for the token at absolute ``position`` of a sequence.

    Randomness is a pure function of (seed, position, stream): a restarted
    worker, a different mode or a different batch composition draws the same
    uniforms for the same token, which keeps seeded runs reproducible.
    """
    return make_generator(_stream_seed(seed, position, stream))


def _stream_seed(seed: int, position: int, stream: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) % (2**63 - 1)


_local = threading.local()


def _scratch_generator() -> torch.Generator:
    """A per-thread CPU generator, re-seeded for every draw: re-seeding resets
    the whole Mersenne-Twister state, so its output equals a fresh generator's
    (see :func:`position_generator`) without building one per row."""
    g = getattr(_local, "generator", None)
    if g is None:
        g = _local.generator = torch.Generator(device="cpu")
    return g


def position_uniforms(seeds: Sequence[int], positions: Sequence[int], n: int = 1, stream: int = STREAM_TARGET) -> torch.Tensor:
    """``[B, n]`` uniforms: row b from :func:`position_generator` (seeds[b], positions[b], stream)."""
    g = _scratch_generator()
    rows = []
    for s, p in zip(seeds, positions):
        g.manual_seed(_stream_seed(s, p, stream))
        rows.append(torch.rand(n, generator=g, dtype=torch.float64, device=g.device))
    return torch.stack(rows) if rows else torch.empty(0, n, dtype=torch.float64, device=g.device)



# ---------------------------------------------------------------- public noise
# A counter-based generator (SplitMix64's finaliser, Steele et al. 2014) over
# int64 tensors: the uniform of token v at a position is a hash of (the
# position's key, v), so any row of noise is computed where the logits are, on
# any device, with no state and no communication. Constants above 2**63 are
# written as their two's-complement int64; multiplication wraps, and the right
# shifts are made logical with a mask.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place on ``z`` (int64) and returned."""
    z ^= _shr(z, 30)
    z *= _MIX1
    z ^= _shr(z, 27)
    z *= _MIX2
    z ^= _shr(z, 31)
    return z


_token_offsets: dict[tuple[int, str], torch.Tensor] = {}


def _offsets(vocab: int, device: torch.device) -> torch.Tensor:
    """``(v + 1) * golden`` for every token id v, built once per vocabulary and device."""
    key = (vocab, str(device))
    if key not in _token_offsets:
        _token_offsets[key] = torch.arange(1, vocab + 1, dtype=torch.int64, device=device).unsqueeze(0) * _GOLDEN
    return _token_offsets[key]


def position_keys(seeds: Sequence[int], positions: Sequence[int]) -> list[int]:
    """The noise key of each (seed, output position): what :func:`race_noise` hashes."""
    return [_stream_seed(s, p, STREAM_RACE) for s, p in zip(seeds, positions)]


def race_noise(keys: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(keys), vocab]`` float64 Exp(1) noise ``E = -log U``, row r a pure
    function of ``keys[r]`` (:func:`position_keys`) and the token id.

    Uniforms take the hash's top 53 bits plus a half step, so they lie in
    (0, 1) and E is finite and positive. Rows are independent across keys and
    tokens as far as the hash is (SplitMix64 passes BigCrush); the tests check
    the race's law."""
    distinct = sorted(set(keys))
    if len(distinct) < len(keys):  # rows that share a position (an SSD tree's branches) share their noise
        rows = race_noise(distinct, vocab, device)
        where = {k: i for i, k in enumerate(distinct)}
        return rows[torch.tensor([where[k] for k in keys], device=rows.device)]
    dev = torch.device(device)
    k = _splitmix(torch.tensor(list(keys), dtype=torch.int64, device=dev).unsqueeze(1))
    offsets = _offsets(vocab, dev)
    if dev.type != "cpu":
        return _exp_noise(k, offsets)
    # on a CPU, a few rows at a time: the ~10 passes of the hash stay in cache (40 rows of
    # a 49k vocabulary at once took 2.2 ms a row, one at a time 0.4)
    out = torch.empty(len(keys), vocab, dtype=torch.float64, device=dev)
    for i in range(0, len(keys), _CPU_ROWS):
        out[i : i + _CPU_ROWS] = _exp_noise(k[i : i + _CPU_ROWS], offsets)
    return out


_CPU_ROWS = 2


def _exp_noise(k: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise of the mixed keys ``k [R, 1]`` at every token offset."""
    z = _splitmix(k + offsets)
    return _shr(z, 11).double().add_(0.5).mul_(2.0**-53).log_().neg_()


def race_scores(probs: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """``probs[r, v] / E_r(v)`` (float64) for each row of ``probs [R, V]``: the
    noisy scores whose argmax is :func:`race_token`. Their order is the order of
    the Gumbel-perturbed log-probabilities ``log p(v) + G(v)`` with
    ``G = -log E``; SSD's fan-out ranks a draft's candidates by them."""
    return probs.double() / race_noise(keys, probs.shape[-1], probs.device)


def race_token(probs: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """The winner of each row's exponential race under its key's noise:
    ``argmax_v p(v) / E(v)`` for ``probs [R, V]`` (the Gumbel-max trick).

    **Lemma (exponential race / Gumbel-max).** For independent E(v) ~ Exp(1) and
    a law p, ``E(v) / p(v)`` is Exp(p(v)); the smallest of independent
    exponentials is the one of v with probability ``p(v) / sum_w p(w)``, so
    ``P(race_token = x) = p(x)``. Zero-probability tokens score 0 and never win
    (a row has a positive entry); a one-hot (greedy) row returns its token. Rows
    need not be normalised. Ties have probability 0 (lowest id on rounding).
    """
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    return argmax_lowest(race_scores(probs, keys))

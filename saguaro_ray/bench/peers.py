"""The peers a user would pick instead of this engine, measured in the same run.

``hf-ar`` is Hugging Face transformers' own ``generate`` on the target
checkpoint (greedy at T = 0, sampling at T > 0); ``hf-assisted`` is its
assisted generation with the same draft as ``assistant_model=``, run with
transformers' own defaults (its dynamic speculation length included) — as a
user of transformers runs it. Both use the benchmark's dtype, torch threads
and prompt token ids, and ignore end-of-sequence like our rows do
(``min_new_tokens``), so every row decodes the same number of tokens.

Transformers decodes one request at a time here (assisted generation only
supports batch 1), so the peers run at batch size 1 only.

Decode time starts at the first generated token (as for our rows, which leave
prefill rounds out): a streamer marks it. Assisted generation hands the
streamer each round's accepted tokens plus its bonus token in one call, so the
number of calls after the first is its number of rounds, which gives its mean
accepted length.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from saguaro_ray.bench.plan import PEER_MODES, TemperatureSetting
from saguaro_ray.bench.report import RunResult, round_breakdown
from saguaro_ray.errors import ConfigError
from saguaro_ray.models.resolve import resolve_models


class _RoundClock:
    """A transformers streamer that records when each chunk of new tokens came."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []  # (time, tokens) per put after the prompt
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt itself
            self._prompt_seen = True
            return
        self.calls.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class PeerRunner:
    """One transformers decoding setup (``hf-ar`` or ``hf-assisted``) with the
    interface of the benchmark's own runners."""

    def __init__(self, mode: str, target: str, draft: str | None, dtype: str | None, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        from saguaro_ray.tokenizer import load_tokenizer
        from saguaro_ray.workers.model_config import parse_dtype

        if mode not in PEER_MODES:
            raise ConfigError(f"unknown peer {mode!r}; choose from {', '.join(PEER_MODES)}")
        if mode == "hf-assisted" and not draft:
            raise ConfigError("hf-assisted needs a draft (--draft) that transformers can load")
        models = resolve_models({"target": target} | ({"draft": draft} if mode == "hf-assisted" else {}))
        # a quantised separate draft (int4:<spec>): transformers assists with the model as stored,
        # as a user of transformers would run it; only a quantised copy of the target has no checkpoint
        if mode == "hf-assisted" and models["draft"].quantize is not None and models["draft"].path == models["target"].path:
            raise ConfigError(
                f"hf-assisted needs a draft checkpoint transformers can load; {draft} is this engine's own "
                "quantised copy of the target (use a draft directory, e.g. one from saguaro-ray draft distill)"
            )
        target = models["target"].path
        self.mode, self.runtime, self.num_drafts = mode, "hf", 1
        self.threads = threads
        torch_dtype = parse_dtype(dtype)
        self.tokenizer = load_tokenizer(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).eval()
        self.assistant = AutoModelForCausalLM.from_pretrained(models["draft"].path, dtype=torch_dtype).eval() if mode == "hf-assisted" else None

    def run(
        self, prompts: list[str], temperatures: TemperatureSetting, max_tokens: int, seed: int, batch_size: int | None = None, first: int = 0
    ) -> RunResult:
        """Generate every prompt one at a time, prompt i at ``temperatures.for_request(first + i)``
        (``first``: the index of ``prompts[0]`` in its run; ``batch_size`` is ignored: see the module's docstring)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        tokens = decode_tokens = rounds = 0
        seconds = decode_seconds = 0.0
        outputs: list[tuple[int, ...]] = []
        try:
            for i, prompt in enumerate(prompts, first):
                ids = torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=False)])
                clock = _RoundClock()
                torch.manual_seed(seed * 100_003 + i)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = self.model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        generation_config=self._config(temperatures.for_request(i), max_tokens),
                        assistant_model=self.assistant,
                        streamer=clock,
                    )
                end = time.perf_counter()
                n = out.shape[1] - ids.shape[1]
                outputs.append(tuple(out[0, ids.shape[1] :].tolist()))
                tokens += n
                seconds += end - t0
                if clock.calls:
                    decode_tokens += n - clock.calls[0][1]
                    decode_seconds += end - clock.calls[0][0]
                    rounds += len(clock.calls) - 1
        finally:
            torch.set_num_threads(previous)
        spec_rounds = rounds if self.assistant is not None else 0
        return RunResult(
            mode=self.mode,
            runtime=self.runtime,
            num_drafts=self.num_drafts,
            batch_size=1,
            temperature=temperatures.label,
            max_tokens=max_tokens,
            seconds=seconds,
            tokens=tokens,
            decode_tokens=decode_tokens,
            decode_seconds=max(decode_seconds, 1e-9),
            # each assisted round emits its accepted draft tokens and one more
            accepted=decode_tokens - spec_rounds if spec_rounds else 0,
            spec_rounds=spec_rounds,
            hits=0,
            lookups=0,
            breakdown=round_breakdown([]),
            seed=seed,
            outputs=outputs,
        )

    def _config(self, temperature: float, max_tokens: int) -> Any:
        """The checkpoint's generation config with the benchmark's sampling:
        exactly ``max_tokens`` new tokens, greedy at T = 0, else plain
        temperature sampling (no top-k/top-p, like our rows)."""
        config = copy.deepcopy(self.model.generation_config)
        sampled = temperature > 0
        config.update(
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=sampled,
            temperature=temperature if sampled else None,
            top_k=0 if sampled else None,
            top_p=1.0 if sampled else None,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id,
        )
        return config

    def close(self) -> None:
        self.model = self.assistant = None

"""Structured output (response_format): the grammar masks, and exactness under speculation.

The unit tests drive :mod:`saguaro_ray.algorithms.grammar` with the tiny zoo's
tokenizer; the engine tests check that every mode emits AR's tokens under the
same grammar at T = 0, that outputs parse and validate, and the law at T > 0.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import test_serve

from saguaro_ray.algorithms.grammar import GrammarCompiler, apply_bitmask, new_bitmask
from saguaro_ray.config import ResponseFormat, SamplingParams
from saguaro_ray.errors import ConfigError
from saguaro_ray.tokenizer import load_tokenizer

test_serve.share_fixtures(globals())  # the Serve tests' Ray cluster, engine and app, as fixtures here too

JSON_OBJECT = ResponseFormat.of({"type": "json_object"})
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
PERSON_FORMAT = ResponseFormat.of({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})


@pytest.fixture(scope="module")
def tokenizer(zoo_tiny):
    return load_tokenizer(zoo_tiny / "target")


def allowed(compiler: GrammarCompiler, fmt: ResponseFormat, history: list[int]) -> set[int]:
    """The allowed next tokens after ``history``, from a fresh state (the reference)."""
    bm = new_bitmask(1, compiler.vocab_size)
    compiler.start(fmt).fill(history, bm, 0)
    row = apply_bitmask(torch.zeros(1, compiler.vocab_size), bm, [0])[0]
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_masks_follow_any_walk_over_histories(tokenizer):
    """One state asked for prefixes in any order (proposals, rejections, tree
    branches) gives exactly the masks of fresh states fed each prefix."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    doc = tokenizer.encode(json.dumps({"name": "Ada", "age": 36, "ok": True}))
    wrong = tokenizer.encode("]")[0]
    rng = random.Random(0)
    histories = [doc[: rng.randint(0, len(doc))] for _ in range(30)]
    histories += [doc[:n] + [wrong] for n in (1, 4)] + [doc[:3]]  # off-grammar branches ("]" after "{", after a key), then back on it
    state = compiler.start(PERSON_FORMAT)
    bm = new_bitmask(len(histories), compiler.vocab_size)
    for i, h in enumerate(histories):
        state.fill(h, bm, i)
    rows = apply_bitmask(torch.zeros(len(histories), compiler.vocab_size), bm, list(range(len(histories))))
    for i, h in enumerate(histories):
        got = set(torch.isfinite(rows[i]).nonzero().flatten().tolist())
        assert got == allowed(compiler, PERSON_FORMAT, h), f"history {i} ({len(h)} tokens)"
        if h and h[-1] == wrong:
            assert got == {tokenizer.eos_token_id}  # a history outside the grammar: EOS only, never an empty law
        elif len(h) < len(doc):
            assert doc[len(h)] in got and len(got) < compiler.vocab_size


def test_complete_grammar_allows_only_eos_and_padding_never(tokenizer):
    """After a complete object only EOS is allowed; the model's padding ids
    past the tokenizer's vocabulary are never allowed."""
    vocab = len(tokenizer) + 40
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    doc = tokenizer.encode('{"a": [1, 2]}')
    assert allowed(compiler, JSON_OBJECT, doc) == {tokenizer.eos_token_id}
    assert allowed(compiler, JSON_OBJECT, doc + [tokenizer.eos_token_id]) == {tokenizer.eos_token_id}
    for n in range(len(doc)):
        assert not allowed(compiler, JSON_OBJECT, doc[:n]) & set(range(len(tokenizer), vocab))
    assert tokenizer.eos_token_id not in allowed(compiler, JSON_OBJECT, doc[:-1])


def test_properties_come_in_the_schema_order(tokenizer):
    """OpenAI writes a schema's properties in the order it lists them; so
    does the grammar (the format keeps the schema's key order)."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    in_order = tokenizer.encode('{"name": "A", "age": 3, "ok": true}')
    assert allowed(compiler, PERSON_FORMAT, in_order) == {tokenizer.eos_token_id}
    assert allowed(compiler, PERSON_FORMAT, tokenizer.encode('{"age": 3')) == {tokenizer.eos_token_id}  # off the grammar


def test_both_unpackings_agree_and_rows_are_masked_in_place(tokenizer):
    """The CPU's byte unpacking and the accelerators' shift unpacking give the
    same mask; a subset of rows is masked, the others are left as they were."""
    from saguaro_ray.algorithms.grammar import banned_by_bytes, banned_by_shifts

    gen = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (3, 70), generator=gen, dtype=torch.int32)
    for vocab in (70 * 32, 70 * 32 - 13):
        assert torch.equal(banned_by_bytes(bm, vocab), banned_by_shifts(bm, vocab))
    logits = torch.randn(5, 70 * 32 - 13, generator=gen)
    out = apply_bitmask(logits, bm[:2], [1, 3])
    banned = banned_by_bytes(bm[:2], logits.shape[1])
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])
    assert torch.equal(out[[1, 3]], logits[[1, 3]].masked_fill(banned, float("-inf")))
    assert all(bool(((bm[0, t // 32] >> (t % 32)) & 1) == 0) == bool(banned[0, t]) for t in (0, 31, 32, 1000))


def test_json_object_needs_an_object(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    first = allowed(compiler, JSON_OBJECT, [])
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in first)


def test_the_compiled_grammar_cache_is_bounded(tokenizer):
    """Every request may bring its own schema: the compiler keeps the latest
    MAX_CACHED_GRAMMARS, a recent one is served from the cache."""
    from saguaro_ray.algorithms.grammar import MAX_CACHED_GRAMMARS

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    fmts = [ResponseFormat.of({"type": "json_schema", "json_schema": {"schema": {"enum": [f"v{i}"]}}}) for i in range(MAX_CACHED_GRAMMARS + 1)]
    first = compiler.compile(fmts[0])
    for f in fmts[1:]:
        compiler.compile(f)
    assert len(compiler) == MAX_CACHED_GRAMMARS
    assert compiler.compile(fmts[-1]) is compiler.compile(fmts[-1])
    assert compiler.compile(fmts[0]) is not first  # evicted, compiled again


def test_unusable_schema_is_a_config_error_naming_response_format(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    bad = ResponseFormat.of({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    with pytest.raises(ConfigError, match=r"^response_format\.json_schema\.schema cannot be compiled to a grammar: Cannot find"):
        compiler.compile(bad)
    with pytest.raises(ConfigError, match="^response_format needs the model's end-of-sequence"):
        GrammarCompiler(tokenizer, len(tokenizer), ())


# ------------------------------------------------------------------ the engine, every mode

MODES = ("sd", "ssd", "pyramid", "auto")
PROMPTS = ["CONFIG = ", "def load(path):\n    return ", "    defaults = "]
BOUNDED_PERSON = {  # every field bounded, so the tiny model completes it within MAX_TOKENS
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "ok", "kind"],
}
FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": BOUNDED_PERSON}},
}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine(zoo_tiny):
    """One engine offering every strategy (auto by default); requests pick theirs."""
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig

    eng = LocalEngine(
        EngineConfig(
            target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), qualifier=str(zoo_tiny / "qualifier"), threads_per_worker=1
        )
    )
    yield eng
    eng.close()


def structured(fmt: dict | None, mode: str, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "response_format": fmt, "speculation": mode} | kw)


def check_output(compiler: GrammarCompiler, fmt: dict, result) -> None:
    """A finished output parses and validates; one cut by max_tokens is a
    prefix the grammar accepts (checked by a fresh grammar state)."""
    import jsonschema

    if result.finish_reason == "stop":
        value = json.loads(result.text)
        schema = fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
        jsonschema.validate(value, schema)
    else:
        assert result.finish_reason == "length" and len(result.token_ids) == MAX_TOKENS
        ids = list(result.token_ids)
        for n, t in enumerate(ids):
            assert t in allowed(compiler, ResponseFormat.of(fmt), ids[:n]), f"token {n} of {result.text!r} leaves the grammar"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_mode_emits_ar_tokens_under_the_grammar_and_outputs_validate(engine, tokenizer, name):
    fmt = FORMATS[name]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    ar = engine.generate(PROMPTS, structured(fmt, "ar"))
    for r in ar:
        check_output(compiler, fmt, r)
    assert any(len(r.text) > 12 for r in ar), [r.text for r in ar]  # not a degenerate "{}"
    if name == "json_schema":
        assert all(r.finish_reason == "stop" for r in ar), [r.text for r in ar]
    unconstrained = engine.generate(PROMPTS, structured(None, "ar"))
    assert [r.token_ids for r in unconstrained] != [r.token_ids for r in ar]  # the grammar did something
    for mode in MODES:
        got = engine.generate(PROMPTS, structured(fmt, mode))
        assert [r.token_ids for r in got] == [r.token_ids for r in ar], mode


def test_a_grammar_with_penalties_and_bias_equals_ar_in_every_mode(engine, tokenizer):
    """Penalties and a bias change which grammatical token wins (the output
    differs from the grammar's alone), the output still validates, and every
    mode emits AR's tokens under both at once."""
    import jsonschema

    fmt = FORMATS["json_schema"]
    quote = tokenizer.encode(' "', add_special_tokens=False)[0]
    extra = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={quote: 100.0})
    ar = engine.generate(PROMPTS, structured(fmt, "ar", **extra))
    assert [r.token_ids for r in ar] != [r.token_ids for r in engine.generate(PROMPTS, structured(fmt, "ar"))]
    for r in ar:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), BOUNDED_PERSON)
    for mode in MODES:
        assert [r.token_ids for r in engine.generate(PROMPTS, structured(fmt, mode, **extra))] == [r.token_ids for r in ar], mode


def test_workers_forget_grammar_states_of_finished_sequences(engine):
    from engine_helpers import settle

    engine.generate(PROMPTS, structured(FORMATS["json_object"], "ssd"))
    settle(engine)
    assert {role: len(w.logic.adjuster.grammar) for role, w in engine.workers.items()} == {role: 0 for role in engine.workers}


# ------------------------------------------------------------------ the law at T > 0

LAW_M = 6  # generated tokens whose joint law is tested
LAW_N = 3000
LAW_SEED = 70_000


def grammar_law(zoo_tiny, tokenizer, fmt: ResponseFormat, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first LAW_M tokens = x) under the grammar, T = 1, top-k 2, by
    enumeration: each row of the target masked by a fresh grammar state of its prefix."""
    from test_exactness_sampling import exact_law

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))

    def mask(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        bm = new_bitmask(1, compiler.vocab_size)
        compiler.start(fmt).fill(history[len(prompt) :], bm, 0)
        return apply_bitmask(logits, bm, [0])

    return exact_law(zoo_tiny / "target", m=LAW_M, temperature=1.0, top_k=2, prompt=prompt, adjust=mask)


def test_the_law_at_t1_is_the_masked_target_law_in_sd_and_ssd(zoo_tiny, tokenizer):
    from test_exactness_sampling import assert_law

    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig

    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    law = grammar_law(zoo_tiny, tokenizer, JSON_OBJECT, prompt)
    assert len(law) > 8  # the grammar leaves choices open
    eng = LocalEngine(
        EngineConfig(
            target=str(zoo_tiny / "target"), draft=str(zoo_tiny / "draft"), threads_per_worker=1,
            max_batch_size=LAW_N, max_kv_tokens=(len(prompt) + 16) * LAW_N,
        )
    )
    try:
        for strategy in ("sd", "ssd"):
            params = SamplingParams(
                temperature=1.0, top_k=2, max_tokens=LAW_M, ignore_eos=True, seed=LAW_SEED, response_format=JSON_OBJECT,
                speculation={"mode": strategy, "k": 2},
            )
            results = eng.generate([prompt], params, n=LAW_N)
            assert all(len(r.token_ids) == LAW_M for r in results)
            assert_law(results, law, strategy)
    finally:
        eng.close()


# ------------------------------------------------------------------ Serve, through Ray, with the official client


def test_serve_chat_and_completions_with_response_format(client, handle, server):
    """The openai client gets validating JSON on chat (json_schema, streamed and
    not) and completions (the extension), each mode equal to AR over Ray's actors;
    a schema the library cannot compile is a 400 naming response_format, and
    the engine serves the next request as before."""
    import httpx
    import jsonschema
    import openai
    from test_serve import MESSAGES, MODEL, TIMEOUT_S, KEY

    fmt = FORMATS["json_schema"]
    texts = {}
    for mode in ("ar", "ssd", "sd"):
        resp = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=fmt, extra_body={"speculation": mode}
        )
        [choice] = resp.choices
        assert choice.finish_reason == "stop"
        texts[mode] = choice.message.content
    assert len(set(texts.values())) == 1, texts
    jsonschema.validate(json.loads(texts["ar"]), BOUNDED_PERSON)
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=fmt, stream=True, extra_body={"speculation": "ssd"}
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["ar"]
    [ref] = handle.generate([PROMPTS[1]], structured(FORMATS["json_object"], "ar"))
    done = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, extra_body={"response_format": FORMATS["json_object"], "speculation": "ssd"}
    )
    assert done.choices[0].text == ref.text and ref.text.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format=bad)
    assert info.value.body["param"] == "response_format" and "cannot be compiled" in info.value.body["message"]
    resp = httpx.post(
        server + "/v1/completions", json={"model": MODEL, "prompt": "x", "response_format": {"type": "yaml"}},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=fmt)
    assert again.choices[0].message.content == texts["ar"]


def every_feature(client, model: str, modes: tuple[str, ...], **extra) -> dict[str, tuple[str, list]]:
    """One chat request asking for a schema, logprobs, penalties, a bias and the
    repetition extension at once, in each of ``modes``: per mode, the content and
    (token, logprob, top tokens) per emitted token."""
    from test_serve import MESSAGES

    answers = {}
    for mode in modes:
        [choice] = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=FORMATS["json_schema"],
            logprobs=True, top_logprobs=3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={"7": -2.0},
            extra_body={"speculation": mode, "repetition_penalty": 1.2, **extra},
        ).choices
        assert choice.finish_reason == "stop"
        answers[mode] = (choice.message.content, [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in choice.logprobs.content])
        ran = (choice.model_extra or {}).get("saguaro") or {}
        if mode != "auto":  # a fixed strategy ran every round (auto picks its own)
            assert set(ran.get("strategy") or {}) == {mode}, (mode, ran)
    return answers


def assert_same_answers(answers: dict[str, tuple[str, list]], reference: str) -> None:
    """Every mode's answer is the reference mode's: the same validating JSON and
    the same logprobs (the target's verification rows, however many a round scores)."""
    import jsonschema

    text, lps = answers[reference]
    jsonschema.validate(json.loads(text), BOUNDED_PERSON)
    # the last entry is the end-of-sequence token the grammar allows once the document is complete
    # (its logprob is reported, as every emitted token's is; its text is not part of the content)
    assert "".join(tok for tok, _, _ in lps[:-1]) == text and all(len(top) <= 3 and lp <= 0 for _, lp, top in lps)
    for mode, (other_text, other) in answers.items():
        assert other_text == text and [(t, top) for t, _, top in other] == [(t, top) for t, _, top in lps], mode
        assert max(abs(a[1] - b[1]) for a, b in zip(other, lps)) < 1e-4, mode


def test_serve_one_request_with_every_feature_is_the_same_in_every_mode(client):
    """ar, sd, ssd and auto (the shared deployment's modes; pyramid below) answer
    one request with every feature on alike, streamed as not."""
    from test_serve import MESSAGES, MODEL

    answers = every_feature(client, MODEL, ("ar", "sd", "ssd", "auto"))
    assert_same_answers(answers, "ar")
    text, lps = answers["ar"]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=FORMATS["json_schema"])
    assert plain.choices[0].message.content != text  # the penalties and bias changed the answer: the equalities above mean something
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=FORMATS["json_schema"], stream=True,
        logprobs=True, top_logprobs=3, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={"7": -2.0},
        extra_body={"speculation": "ssd", "repetition_penalty": 1.2},
    )
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in streamed) == text
    assert [t.token for c in streamed if c.logprobs for t in c.logprobs.content] == [t for t, _, _ in lps]


@pytest.fixture(scope="module")
def pyramid_client(ray_cluster, server, zoo_tiny):
    """A second application on the same Serve: one engine with a qualifier,
    allowing pyramid and ar (the shared deployment has no qualifier)."""
    import openai
    import uuid
    from ray import serve
    from test_serve import KEY, TIMEOUT_S, bounded

    from saguaro_ray import Engine, EngineConfig
    from saguaro_ray.serve import build_app
    from saguaro_ray.serve.config import speculation_config

    spec = {"mode": "pyramid", "allow": ["pyramid", "ar"], "lq": 3, "ld": 2}
    name = f"pyramid-{uuid.uuid4().hex[:8]}"
    paths = {role: str(zoo_tiny / role) for role in ("target", "draft", "qualifier")}
    h = bounded(Engine.launch, EngineConfig(**paths, spec=speculation_config(spec), worker_cpus=0.25, name=name))
    app = build_app({"model_name": "pyramid", **paths, "speculation": spec, "connect": name, "api_keys": [KEY]})
    bounded(serve.run, app, name="pyramid", route_prefix="/pyramid", blocking=False, timeout=300)
    try:
        yield openai.OpenAI(base_url=server + "/pyramid/v1", api_key=KEY, timeout=TIMEOUT_S, max_retries=0)
    finally:
        bounded(serve.delete, "pyramid", timeout=120)
        h.shutdown()


def test_serve_pyramid_answers_every_feature_as_ar(pyramid_client):
    assert_same_answers(every_feature(pyramid_client, "pyramid", ("ar", "pyramid")), "ar")


def test_bench_requests_under_a_format_end_at_eos():
    """``--sampling '{"response_format": ...}'``: the bench's requests carry the
    format and stop at EOS (past a complete document only EOS is allowed;
    decoding those rows would flatter every mode); plain ones ignore EOS."""
    from saguaro_ray.bench.plan import SamplingSetting, temperature_settings
    from saguaro_ray.bench.run import request_params

    [t0] = temperature_settings([0.0], None)
    structured_ = request_params(2, t0, 16, 0, None, sampling=SamplingSetting({"response_format": {"type": "json_object"}}))
    assert all(p.response_format == JSON_OBJECT and not p.ignore_eos for p in structured_)
    plain = request_params(2, t0, 16, 0, None, sampling=SamplingSetting({"response_format": {"type": "text"}}))
    assert all(p.response_format is None and p.ignore_eos for p in plain)

"""Guided decoding (`engine/guided.py`) with the bundled model's real tokenizer: random walks
over allowed tokens produce text that parses and validates; masks, EOS, replay, batch fill,
errors."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import msgspec
import pytest
import torch

from pdserve import envs
from pdserve.engine import guided
from pdserve.engine.guided import (
    GuideCompiler,
    GuideError,
    GuideSpec,
    apply_bitmask,
    check_spec,
    unpack_bitmask,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
JSON_OBJECT = GuideSpec("json_object")
JSON_SCHEMA = GuideSpec("json_schema", json.dumps(SCHEMA))
REGEX = GuideSpec("regex", r"[0-9]{3}-[a-z]{2,5}")
GRAMMAR = GuideSpec(
    "grammar", 'start: answer\nanswer: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/\n'
)
EXTRA = 64  # logits wider than the tokenizer's vocabulary, as padded embedding tables are


@pytest.fixture(scope="session")
def tokenizer():
    from pdserve.model.loader import load_tokenizer

    tok = load_tokenizer(None)  # extracts the GGUF's tokenizer into the cache once
    assert tok.vocab_size == 49152
    return tok


@pytest.fixture(scope="session")
def tokenizer_file(tokenizer):
    """Where load_tokenizer saved the bundled model's tokenizer.json."""
    from pdserve.model.loader import fingerprint, load_model_config

    path, config = load_model_config(None)
    assert config.vocab_size == 49152
    return envs.cache_dir() / "tokenizers" / fingerprint(path, config) / "tokenizer.json"


@pytest.fixture(scope="session")
def compiler(tokenizer, tokenizer_file):
    return GuideCompiler(tokenizer_file, 49152, [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def wide(tokenizer, tokenizer_file):
    """Logits EXTRA ids wider than the vocabulary, and two EOS ids."""
    eos = [tokenizer.eos_token_id, tokenizer.encode("<|endoftext|>")[0]]
    return GuideCompiler(tokenizer_file, 49152 + EXTRA, eos)


def allowed_ids(guide) -> list[int]:
    return guide.allowed().nonzero().view(-1).tolist()


def walk(compiler, tokenizer, spec, seed, close=0.5, max_steps=400) -> tuple[str, list[int]]:
    """Random allowed tokens until the guide is finished or EOS is drawn. Closing tokens (and
    EOS) are preferred with probability `close` so that strings and objects end soon."""
    rng = random.Random(seed)
    closers = {tokenizer.encode(c)[0] for c in ('"', "}", "]")} | set(compiler.eos_token_ids)
    guide, tokens = compiler.guide(spec), []
    for _ in range(max_steps):
        if guide.is_finished:
            return tokenizer.decode(tokens, skip_special_tokens=False), tokens
        allowed = allowed_ids(guide)
        closing = [t for t in allowed if t in closers]
        token = rng.choice(closing if closing and rng.random() < close else allowed)
        if token in compiler.eos_token_ids:
            return tokenizer.decode(tokens, skip_special_tokens=False), tokens
        guide.accept(token)
        tokens.append(token)
    pytest.fail(f"{spec.kind}: not finished after {max_steps} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_json_object_walk_parses_to_an_object(compiler, tokenizer, seed):
    text, _ = walk(compiler, tokenizer, JSON_OBJECT, seed, close=0.25)  # nested, numbers
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_walk_validates(compiler, tokenizer, seed):
    text, _ = walk(compiler, tokenizer, JSON_SCHEMA, seed)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text.startswith('{"name":"'), text  # compact: properties in order, no whitespace


@pytest.mark.parametrize("seed", range(4))
def test_regex_walk_fully_matches(compiler, tokenizer, seed):
    text, _ = walk(compiler, tokenizer, REGEX, seed)
    assert re.fullmatch(REGEX.spec, text), text


@pytest.mark.parametrize("seed", range(4))
def test_grammar_walk_is_in_the_language(compiler, tokenizer, seed):
    text, _ = walk(compiler, tokenizer, GRAMMAR, seed)
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", text), text


def test_json_is_compact(compiler, tokenizer):
    """No whitespace between JSON tokens; forced bytes come as their canonical tokens."""
    assert allowed_ids(compiler.guide(JSON_SCHEMA)) == tokenizer.encode('{"')  # '{"name":"'
    guide = compiler.guide(JSON_OBJECT, tokenizer.encode('{"a":'))
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in allowed_ids(guide)]
    assert len(texts) > 10 and '"' in texts and "1" in texts
    assert not [t for t in texts if t[0].isspace()]


def test_finished_guide_allows_only_eos(compiler, tokenizer):
    guide = compiler.guide(JSON_OBJECT, tokenizer.encode('{"a":1}'))
    assert guide.is_finished
    assert allowed_ids(guide) == [tokenizer.eos_token_id]


def test_accepting_regex_allows_eos_and_more(compiler, tokenizer):
    guide = compiler.guide(GuideSpec("regex", "a+"), tokenizer.encode("a"))
    assert not guide.is_finished
    allowed = allowed_ids(guide)
    assert tokenizer.eos_token_id in allowed and tokenizer.encode("a")[0] in allowed


def test_disallowed_token_is_rejected(compiler, tokenizer):
    guide = compiler.guide(JSON_SCHEMA)
    token = tokenizer.encode("hello")[0]
    assert not guide.allowed()[token]
    with pytest.raises(GuideError, match=f"token {token} is not allowed"):
        guide.accept(token)
    assert guide.error and not guide.is_finished


def test_ids_beyond_the_tokenizer_are_never_allowed(wide, tokenizer):
    for spec in (JSON_OBJECT, GuideSpec("regex", "(.|\n)*")):
        allowed = wide.guide(spec).allowed()
        assert allowed.shape == (49152 + EXTRA,) and allowed[:49152].any()
        assert not allowed[49152:].any(), spec
    with pytest.raises(GuideError):
        wide.guide(JSON_OBJECT).accept(49152 + 3)


def test_every_eos_id_is_allowed_at_the_end(wide, tokenizer):
    guide = wide.guide(GuideSpec("regex", "ab"), tokenizer.encode("ab"))
    assert guide.is_finished
    assert allowed_ids(guide) == sorted(wide.eos_token_ids)


def test_batch_fill_matches_each_guide(compiler, tokenizer):
    guides = [
        compiler.guide(JSON_OBJECT),
        compiler.guide(JSON_SCHEMA, tokenizer.encode('{"name":"Al')),
        None,  # an unguided sequence in the same batch
        compiler.guide(REGEX, tokenizer.encode("12")),
        compiler.guide(GRAMMAR),
    ]
    bitmask = compiler.allocate_bitmask(len(guides) + 1).zero_()  # stale rows: all disallowed
    bitmask[-1] = 7  # a spare row: left alone
    compiler.fill_bitmask(guides, bitmask)
    rows = unpack_bitmask(bitmask, compiler.vocab_size)
    for i, guide in enumerate(guides):
        expected = guide.allowed() if guide else torch.ones(compiler.vocab_size, dtype=torch.bool)
        assert torch.equal(rows[i], expected), i
    assert len({tuple(r.nonzero().view(-1).tolist()) for r in rows[:5]}) == 5  # all differ
    assert bitmask[-1].eq(7).all()


def test_fill_refuses_a_wrong_bitmask(compiler):
    with pytest.raises(ValueError, match="contiguous CPU int32"):
        compiler.fill_bitmask([None], torch.zeros(1, compiler.words, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(>= 2, 1536\)"):
        compiler.fill_bitmask([None, None], compiler.allocate_bitmask(1))


def test_apply_sets_disallowed_logits_to_minus_inf(wide, tokenizer):
    guides = [wide.guide(REGEX), None, wide.guide(JSON_OBJECT)]
    bitmask = wide.allocate_bitmask(4)
    wide.fill_bitmask(guides, bitmask)
    logits = torch.randn(3, wide.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_bitmask(logits, bitmask)
    allowed = unpack_bitmask(bitmask[:3], wide.vocab_size)
    assert torch.equal(logits[allowed], before[allowed])
    assert logits[~allowed].eq(float("-inf")).all()
    assert torch.equal(logits[1], before[1])  # unguided row untouched
    assert logits[0].isfinite().nonzero().view(-1).tolist() == allowed_ids(guides[0])
    assert logits[2, 49152:].eq(float("-inf")).all()


def test_replayed_prefix_gives_the_same_masks_as_stepping(compiler, tokenizer):
    _, tokens = walk(compiler, tokenizer, JSON_SCHEMA, seed=7)
    assert len(tokens) >= 5
    stepped = compiler.guide(JSON_SCHEMA)
    for k, token in enumerate(tokens):
        replayed = compiler.guide(JSON_SCHEMA, tokens[:k])
        assert torch.equal(replayed.allowed(), stepped.allowed()), k
        stepped.accept(token)
    assert compiler.guide(JSON_SCHEMA, tokens).is_finished == stepped.is_finished


def test_a_replayed_prefix_that_does_not_fit_is_refused(compiler, tokenizer):
    with pytest.raises(GuideError, match="replayed token 2 of 3"):
        compiler.guide(REGEX, tokenizer.encode("12") + tokenizer.encode("x"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuideSpec("json_schema", "{not json"), "schema is not valid JSON: .*send the schema"),
        (GuideSpec("json_schema", '{"type": "objec"}'), r"not a valid JSON schema: .*\$\.type"),
        (GuideSpec("json_schema", "[1]"), "must be a JSON object, got list"),
        (GuideSpec("json_schema", '{"dependentRequired": {"a": ["b"]}}'), "cannot be enforced"),
        (GuideSpec("regex", "a(b"), "^the regex is not valid: unclosed group; fix the regex"),
        (GuideSpec("regex", "(?=a)b"), "look-around"),
        (GuideSpec("grammar", "start: foo\n"), 'Lark grammar is not valid: .*"foo"'),
        (GuideSpec("xml", "<a/>"), "unknown guide kind 'xml': use one of json_object"),
        (GuideSpec("json_object", "{}"), "json_object takes no spec"),
    ],
)
def test_bad_specs_say_what_to_fix(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        check_spec(spec)
    with pytest.raises(ValueError, match=message):
        compiler.guide(spec)


def test_check_spec_is_cached(compiler):
    spec = GuideSpec("regex", "cached[0-9]+")
    check_spec(spec)
    hits = guided._grammar.cache_info().hits
    check_spec(GuideSpec("regex", "cached[0-9]+"))  # an equal spec from another message
    assert guided._grammar.cache_info().hits == hits + 1


def test_spec_round_trips_through_msgpack():
    wire = msgspec.msgpack.encode(JSON_SCHEMA)
    assert msgspec.msgpack.decode(wire, type=GuideSpec) == JSON_SCHEMA
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(JSON_OBJECT), type=GuideSpec).spec == ""


def test_a_draft_is_valid_up_to_the_first_token_the_grammar_refuses(compiler, tokenizer):
    guide = compiler.guide(JSON_SCHEMA)
    good = tokenizer.encode('{"name":"Ann","age":')
    assert guide.valid_prefix(good) == len(good)
    assert guide.valid_prefix([*good, *tokenizer.encode('"x"')]) == len(good)  # age: integer
    assert guide.valid_prefix([]) == 0
    assert allowed_ids(guide) == tokenizer.encode('{"')  # nothing was consumed


def test_draft_rows_hold_the_masks_after_each_proposal_and_leave_the_guide(compiler, tokenizer):
    """Speculative decoding's verify rows: row j is what the guide allows after draft[:j]."""
    draft = tokenizer.encode('{"name":"Bo","age":4')
    guide = compiler.guide(JSON_SCHEMA)
    plain = compiler.guide(REGEX)
    bitmask = compiler.allocate_bitmask(2 + len(draft) + 1)
    compiler.fill_bitmask([plain, None], bitmask, [(guide, 2, draft)])
    rows = unpack_bitmask(bitmask, 49152)
    assert torch.equal(rows[0], plain.allowed()) and rows[1].all()  # None: everything
    for j in range(len(draft) + 1):
        assert torch.equal(rows[2 + j], compiler.guide(JSON_SCHEMA, draft[:j]).allowed()), j
    assert allowed_ids(guide) == tokenizer.encode('{"')  # the guide did not move

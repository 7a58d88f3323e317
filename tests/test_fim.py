"""Fill-in-the-middle: `suffix` on /v1/completions. Tokenizer.encode_fim builds each known
family's prompt (prefix-suffix-middle for Qwen2.5-Coder, StarCoder, SantaCoder, DeepSeek
Coder and CodeLlama; suffix-prefix for Codestral), checked against the prompt each family
documents, written out as text and tokenized, and for SentencePiece-style vocabularies
against a tokenizer that puts no space before the suffix; the server answers with the
middle (with echo: prompt, middle, suffix), streamed or not, stops at the format's end
tokens, and refuses suffix on a model without FIM tokens with a 400 naming it."""
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.random_model import make_random_model
from cupy_llama.errors import RequestError
from cupy_llama.tokenizer import FIM_FORMATS, Tokenizer

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return total\n"
FORMATS = {fim.name: fim for fim in FIM_FORMATS}


def with_tokens(model_dir, texts) -> Tokenizer:
    """model_dir's tokenizer.json with texts added as special tokens (in place)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    path = model_dir / "tokenizer.json"
    backend = Backend.from_file(str(path))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts])
    backend.save(str(path))
    return Tokenizer.from_dir(model_dir)


def fim_tokens(fim) -> list[str]:
    return [t for t in (fim.prefix, fim.suffix, fim.middle, *fim.ends) if t]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    """The tiny random model with Qwen2.5-Coder's FIM tokens, and its LLM."""
    model_dir = make_random_model(tmp_path_factory.mktemp("fim") / "model", "tiny", seed=0,
                                  std=0.15)
    with_tokens(model_dir, fim_tokens(FORMATS["qwen"]))
    llm = LLM(model_dir, device="cpu", log=None)
    yield model_dir, llm
    llm.close()


# ---- the prompt of each family ----------------------------------------------------------

# the prompts as the families' documentation writes them ({p}: prefix, {s}: suffix)
DOCUMENTED = {
    "qwen": "<|fim_prefix|>{p}<|fim_suffix|>{s}<|fim_middle|>",
    "starcoder": "<fim_prefix>{p}<fim_suffix>{s}<fim_middle>",
    "santacoder": "<fim-prefix>{p}<fim-suffix>{s}<fim-middle>",
    "deepseek_coder": "<\uff5cfim\u2581begin\uff5c>{p}<\uff5cfim\u2581hole\uff5c>{s}"
                      "<\uff5cfim\u2581end\uff5c>",
    "mistral": "[SUFFIX]{s}[PREFIX]{p}",
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_byte_level_prompts_are_the_documented_ones(tmp_path, name):
    """On a byte-level vocabulary (no implicit spaces) the prompt is the documented text,
    tokenized with its FIM tokens as tokens (and the tokenizer's BOS, if it adds one)."""
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0)
    tokenizer = with_tokens(model_dir, fim_tokens(FORMATS[name]))
    assert tokenizer.fim_format.name == name
    for prefix, suffix in ((PREFIX, SUFFIX), ("x = ", ""), ("", " y")):
        text = DOCUMENTED[name].format(p=prefix, s=suffix)
        assert tokenizer.encode_fim(prefix, suffix) == tokenizer.encode(text), (prefix, suffix)


def sentencepiece_tokenizer(specials, style):
    """A small BPE over SentencePiece-style pieces (a space is "\u2581", and one goes
    before a text, as in Llama 2's and Mistral's vocabularies: through a Metaspace
    pre-tokenizer, or through the normalizer as their tokenizer.json files do), BOS added;
    and the same vocabulary putting no space before a text (the reference)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, processors, trainers
    backend = Backend(models.BPE(unk_token="<unk>"))
    space = "\u2581"
    if style == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="first")
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(space),
                                                   normalizers.Replace(" ", space)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", *specials])
    backend.train_from_iterator([PREFIX + SUFFIX, "x = y + z", "return a + b"] * 4, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    never = Backend.from_str(backend.to_str())
    if style == "metaspace":
        never.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="never")
    else:
        never.normalizer = normalizers.Replace(" ", space)
    return backend, never


@pytest.mark.parametrize("style", ["metaspace", "normalizer"])
@pytest.mark.parametrize("name", ["codellama", "mistral"])
def test_sentencepiece_prompts_put_no_space_before_the_suffix(name, style):
    """CodeLlama's infilling_prompt_tokens and mistral-common's encode_fim: BOS, the FIM
    tokens, the prefix encoded as usual (with its implicit leading space) and the suffix
    without one; the reference suffix comes from the same vocabulary putting no space
    before a text."""
    fim = FORMATS[name]
    backend, never = sentencepiece_tokenizer(fim_tokens(fim), style)
    tokenizer = Tokenizer(backend, None, "<s>", "</s>")
    assert tokenizer.fim_format == fim
    ids = {t: backend.token_to_id(t) for t in fim_tokens(fim) + ["<s>"]}
    for prefix, suffix in ((PREFIX, SUFFIX), ("x = ", "+ z"), ("return", " a")):
        prefix_ids = backend.encode(prefix, add_special_tokens=False).ids
        suffix_ids = never.encode(suffix, add_special_tokens=False).ids
        assert backend.id_to_token(prefix_ids[0]).startswith("\u2581")  # the implicit space
        if not suffix.startswith(" ") or style == "normalizer":  # (Metaspace puts none
            # before a space)
            assert backend.encode(suffix, add_special_tokens=False).ids != suffix_ids, \
                "the suffix has no implicit space to leave out: the test proves nothing"
        if fim.suffix_first:
            expected = [ids["<s>"], ids[fim.suffix], *suffix_ids, ids[fim.prefix], *prefix_ids]
        else:
            expected = [ids["<s>"], ids[fim.prefix], *prefix_ids, ids[fim.suffix], *suffix_ids,
                        ids[fim.middle]]
        assert tokenizer.encode_fim(prefix, suffix) == expected, (prefix, suffix)
    if name == "codellama":  # the middle ends at <EOT>
        assert tokenizer.fim_end_token_ids == [ids["\u2581<EOT>"]]


def test_a_vocabulary_without_fim_tokens(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.fim_format is None
    with pytest.raises(RequestError, match="this model has no fill-in-the-middle tokens"):
        tokenizer.encode_fim("a", "b")


def test_a_partial_set_is_no_format(tmp_path):
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0)
    assert with_tokens(model_dir, ["<|fim_prefix|>", "<|fim_suffix|>"]).fim_format is None


# ---- through the server ------------------------------------------------------------------

pytest.importorskip("fastapi")
from inprocess_server import ask, ask_one, make_state  # noqa: E402

GREEDY = {"temperature": 0, "max_tokens": 12}


def test_the_completion_is_the_middle(fim_model):
    """Greedy text from the server equals the engine's from the FIM prompt; usage counts
    the FIM prompt's tokens; echo gives prompt + middle + suffix, streamed or not; each of
    several prompts gets its own middle."""
    model_dir, llm = fim_model
    fim_prompt = llm.tokenizer.encode_fim(PREFIX, SUFFIX)
    stops = llm.tokenizer.fim_end_token_ids
    assert stops, "the format's end tokens were not found: the test proves less"
    want = llm.generate(fim_prompt, SamplingParams(**GREEDY, stop_token_ids=stops))
    plain = llm.generate(llm.tokenizer.encode(PREFIX), SamplingParams(**GREEDY))
    assert want.token_ids != plain.token_ids, "the suffix changed nothing: the test proves nothing"
    body = {"prompt": PREFIX, "suffix": SUFFIX, **GREEDY}
    state = make_state(model_dir, llm)
    whole, echoed, streamed, several = ask(state, [
        ("POST", "/v1/completions", {"json": body}),
        ("POST", "/v1/completions", {"json": {**body, "echo": True}}),
        ("POST", "/v1/completions", {"json": {**body, "echo": True, "stream": True}}),
        ("POST", "/v1/completions", {"json": {**body, "prompt": [PREFIX, "x = "]}})])
    answer = whole.json()
    assert answer["choices"][0]["text"] == want.text
    assert answer["usage"]["prompt_tokens"] == len(fim_prompt)
    assert echoed.json()["choices"][0]["text"] == PREFIX + want.text + SUFFIX
    text = "".join(e["choices"][0]["text"] for e in streamed.events() if e["choices"])
    assert text == PREFIX + want.text + SUFFIX
    other = llm.generate(llm.tokenizer.encode_fim("x = ", SUFFIX),
                         SamplingParams(**GREEDY, stop_token_ids=stops))
    assert [c["text"] for c in several.json()["choices"]] == [want.text, other.text]


def test_the_format_end_tokens_stop_beside_the_request_own(fim_model):
    from cupy_llama.sampling import model_sampling_defaults
    from cupy_llama.server.protocol import CompletionRequest, parse
    model_dir, llm = fim_model
    defaults = model_sampling_defaults(llm.config.generation_config)
    ends = llm.tokenizer.fim_end_token_ids
    request = parse(CompletionRequest, {"prompt": "a", "suffix": "b", "stop_token_ids": [7]})
    _, (params,) = request.engine_inputs(llm.tokenizer, llm.config.vocab_size, 256, defaults)
    assert params.stop_token_ids == [7, *ends]
    plain = parse(CompletionRequest, {"prompt": "a", "suffix": "", "stop_token_ids": [7]})
    (prompt,), (params,) = plain.engine_inputs(llm.tokenizer, llm.config.vocab_size, 256,
                                               defaults)
    assert params.stop_token_ids == [7] and prompt == llm.tokenizer.encode("a")  # "": none


BAD = [  # (fields, the param named, words in the message)
    ({"prompt": [1, 2, 3], "suffix": "x"}, "suffix", "suffix needs the prompt as text"),
    ({"prompt": "a", "suffix": 5}, "suffix", "suffix must be a string"),
    ({"prompt": "a", "suffix": "x", "echo": True, "logprobs": 1}, "suffix",
     "echo with logprobs is not supported beside suffix"),
]


@pytest.mark.parametrize("fields, param, words", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_suffix_requests(fim_model, fields, param, words):
    model_dir, llm = fim_model
    answer = ask_one(make_state(model_dir, llm), "POST", "/v1/completions", json=fields)
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_model_without_fim_tokens_refuses_suffix(model_dir, llm):
    """The demo tiny model: a 400 naming suffix, on its own and streamed; "" is no suffix."""
    state = make_state(model_dir, llm)
    refused, streamed, empty = ask(state, [
        ("POST", "/v1/completions", {"json": {"prompt": "a", "suffix": "b"}}),
        ("POST", "/v1/completions", {"json": {"prompt": "a", "suffix": "b", "stream": True}}),
        ("POST", "/v1/completions", {"json": {"prompt": "a", "suffix": "", **GREEDY}})])
    for answer in (refused, streamed):
        assert answer.status == 400, answer.body
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("suffix", "unsupported_parameter")
        assert "this model has none" in error["message"] and "fill-in-the-middle" in error["message"]
    assert empty.status == 200
    assert empty.json()["choices"][0]["text"] == llm.generate("a", SamplingParams(**GREEDY)).text


def test_a_suffix_too_long_for_the_context_is_refused_before_tokenizing(fim_model):
    from cupy_llama.server.protocol import APIError, CompletionRequest, parse
    _, llm = fim_model
    request = parse(CompletionRequest, {"prompt": ["a", "b"], "suffix": "z" * 200})
    with pytest.raises(APIError) as caught:
        request.engine_inputs(llm.tokenizer, llm.config.vocab_size, 256, {},
                              max_prompt_bytes=100)
    assert (caught.value.param, caught.value.code) == ("prompt[0]", "context_length_exceeded")

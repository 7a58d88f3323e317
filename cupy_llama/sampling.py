"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

import json
import math
import numbers
import struct
from dataclasses import dataclass, field, fields

from .errors import ConfigError, RequestError
from .structured import StructuredSpec
from .util import as_flag

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


def as_float32(value: float) -> float:
    """value rounded to float32 (without numpy: the scheduler side imports no numpy)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# Fields a request may set; a request that leaves one out takes the model's default
# (generation_config.json) or, failing that, the dataclass default. max_tokens too, from
# the file's max_new_tokens (vLLM's rule; a server's default where a request leaves it out)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MODEL_DEFAULT_FIELDS = GENERATION_DEFAULT_FIELDS + ("max_tokens",)
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (as OpenAI's API allows)
MAX_N = 128  # samples per request
MAX_LOGIT_BIAS = 300  # entries of logit_bias (as OpenAI's API allows)
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100]
MAX_REPETITION_PENALTY = 100.0  # and its inverse the least: logits stay finite in float32
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids of one request (their bans share the bias table)
MAX_BANNED_TOKENS = 128  # tokens one request's bad_words may ban at every step
# bad words of more than one token one request may ban (vLLM's limits): sequences, and
# their tokens in all
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 1024
# max_tokens=None (vLLM's "no limit"): the output ends at the context limit, as any does there
NO_MAX_TOKENS = 2**63 - 1
# a temperature below this decodes greedily, as vLLM's do: logits divided by less would leave
# float32's range on the device
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy (so does anything below GREEDY_BELOW)
    top_p: float = 1.0         # 1.0 means off
    top_k: int = 0             # 0 means off (-1 too, vLLM's way: taken as 0)
    min_p: float = 0.0         # 0.0 means off
    max_tokens: int = 256      # None: up to the context limit (NO_MAX_TOKENS)
    seed: int | None = None    # None (or -1, as in vLLM): a fresh random seed per request
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the text
    ignore_eos: bool = False
    # None: no log-probabilities; k: each generated token's log-probability and those of the
    # k most likely tokens, from the model's log-softmax before temperature and filters
    # (after the penalties and biases, where the request has any)
    logprobs: int | None = None
    n: int = 1                 # samples of the prompt (RequestOutput.index tells them apart)
    # None, or what the output must follow: a StructuredSpec (a JSON schema, any JSON
    # object, a regex, a choice list or a Lark grammar), or vLLM's structured_outputs
    # object ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ...},
    # {"json_object": true}), turned into a StructuredSpec here
    structured: StructuredSpec | None = None
    # Penalties, applied to the logits on the device before temperature (vLLM's formulas):
    # repetition divides a positive logit (multiplies a negative one) of every token seen in
    # the prompt or the output; frequency subtracts penalty * count of each token in the
    # output, presence subtracts the penalty from every token in the output
    repetition_penalty: float = 1.0  # 1.0 means off
    frequency_penalty: float = 0.0   # in [-2, 2]; 0.0 means off
    presence_penalty: float = 0.0    # in [-2, 2]; 0.0 means off
    # token id -> added to its logit, in [-100, 100] (-100 all but bans it)
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0        # EOS and stop_token_ids are banned until this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # stop at any of these tokens
    include_stop_str_in_output: bool = False  # the stop string ends the text, not cut
    skip_special_tokens: bool = True           # special tokens leave no text
    # between special tokens' texts where they are kept (the tokenizer decides)
    spaces_between_special_tokens: bool = True
    # never generated (vLLM's extension): a word of tokens t1..tn bans tn wherever the
    # output ends with t1..t(n-1), the word spelled as it is and after a space
    bad_words: list[str] = field(default_factory=list)
    # None: none; k: each prompt token's log-probability given the tokens before it, and the
    # k most likely tokens there (RequestOutput.prompt_logprobs). The prompt is then computed
    # whole, without the prefix cache
    prompt_logprobs: int | None = None
    # None: any token; else the only token ids that may be sampled (vLLM's extension). EOS
    # ends the output only where it is listed, as in vLLM; the engine checks the ids
    # against the model's vocabulary. Not with `structured` (one constraint per request)
    allowed_token_ids: list[int] | None = None

    def __post_init__(self):
        # None for a field that vLLM declares optional: its default
        for name, empty in (("stop", list), ("stop_token_ids", list), ("bad_words", list),
                            ("logit_bias", dict)):
            if getattr(self, name) is None:
                setattr(self, name, empty())
        if self.max_tokens is None:
            self.max_tokens = NO_MAX_TOKENS
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.structured, dict):
            self.structured = StructuredSpec.from_structured_outputs(self.structured,
                                                                     "structured")
        # NumPy scalars (np.int64, np.float32, ...) count as the Python numbers they hold
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if as_flag(getattr(self, name)) is not None:
                setattr(self, name, as_flag(getattr(self, name)))
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if isinstance(self.logit_bias, dict):  # JSON keys are strings: "50256": -100
            self.logit_bias = {_token_key(k): _as_float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [int(t) if isinstance(t, numbers.Integral)
                                   and not isinstance(t, bool) else t for t in self.stop_token_ids]
        ids = self.allowed_token_ids
        if hasattr(ids, "tolist") and not isinstance(ids, list):  # a NumPy array
            ids = ids.tolist()
        if isinstance(ids, (tuple, set, frozenset, range)):
            ids = list(ids)
        self.allowed_token_ids = ids
        if isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = [int(t) if isinstance(t, numbers.Integral)
                                      and not isinstance(t, bool) else t
                                      for t in self.allowed_token_ids]
        for name in ("top_k", "max_tokens", "seed", "logprobs", "n", "min_tokens",
                     "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and type(value) not in (bool, int):
                setattr(self, name, int(value))
        if self.top_k == -1 and type(self.top_k) is int:
            self.top_k = 0
        if self.seed == -1 and type(self.seed) is int:  # vLLM's "no seed"
            self.seed = None
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and type(value) not in (bool, int, float):
                setattr(self, name, float(value))
        self.validate()
        if 0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    def validate(self) -> None:
        def number(name, value, ok, rule):
            # an int is finite, and past float's range it compares without converting
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not (isinstance(value, int) or math.isfinite(value)) or not ok(value)):
                raise RequestError(f"{name} must be {rule}, got {_preview(value)}")

        # the device works in float32 and int32: a value must survive that conversion
        number("temperature", self.temperature, lambda v: 0 <= v <= FLOAT32_MAX,
               "a number >= 0 (0 means greedy) that fits a float32")
        number("top_p", self.top_p, lambda v: 0 < v <= 1 and as_float32(v) > 0,
               "in (0, 1] and not so small that float32 rounds it to 0")
        number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                or not 0 <= self.top_k < 2**31):
            raise RequestError(f"top_k must be an integer in [0, 2^31) (0 or -1 means off), "
                               f"got {_preview(self.top_k)}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got "
                               f"{_preview(self.max_tokens)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [0, 2^64) (-1 means none), got "
                               f"{_preview(self.seed)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(f"stop must be a non-empty string or a list of them, got "
                               f"{_preview(self.stop)}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {_preview(self.ignore_eos)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or none), "
                               f"got {_preview(self.logprobs)}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise RequestError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (or "
                               f"none), got {_preview(self.prompt_logprobs)}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer from 1 to {MAX_N} (samples per "
                               f"prompt), got {_preview(self.n)}")
        # a logit divided or multiplied by it must stay a float32 number
        number("repetition_penalty", self.repetition_penalty,
               lambda v: 1 / MAX_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
               f"in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 means off)")
        number("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2,
               "in [-2, 2] (0 means off)")
        number("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2,
               "in [-2, 2] (0 means off)")
        if not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias must map token ids to biases (an object such as "
                               f'{{"50256": -100}}), got {_preview(self.logit_bias)}')
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to "
                               f"biases, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if not _is_token_id(token):
                raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got "
                                   f"{_preview(token)}")
            number(f"logit_bias of token {token}", bias,
                   lambda v: -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE,
                   f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            # max_tokens None has no number to show: the context limit ends the output
            rule = "from 0 to 2**63 - 1" if self.max_tokens == NO_MAX_TOKENS else \
                f"from 0 to max_tokens ({self.max_tokens})"
            raise RequestError(f"min_tokens must be an integer {rule}, got "
                               f"{_preview(self.min_tokens)}")
        if (not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_token_id(t) for t in self.stop_token_ids)):
            raise RequestError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                               f"token ids (integers >= 0), got {_preview(self.stop_token_ids)}")
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got "
                                   f"{_preview(getattr(self, name))}")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip()
                                                           for w in self.bad_words):
            raise RequestError(f"bad_words must be a list of non-blank strings, got "
                               f"{_preview(self.bad_words)}")
        if len(self.bad_words) > MAX_BANNED_TOKENS + MAX_BAD_WORD_SEQUENCES:
            raise RequestError(f"bad_words holds {len(self.bad_words)} words; at most "
                               f"{MAX_BANNED_TOKENS + MAX_BAD_WORD_SEQUENCES}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise RequestError(f"structured must be a StructuredSpec or an object such as "
                               f"{{\"json\": schema}}, got {type(self.structured).__name__}")
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                    or not all(_is_token_id(t) for t in self.allowed_token_ids)):
                raise RequestError(f"allowed_token_ids must be a non-empty list of token ids "
                                   f"(integers >= 0), got {_preview(self.allowed_token_ids)}")
            if self.structured is not None:
                raise RequestError("allowed_token_ids and structured both constrain the "
                                   "output; send one of them")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether the device keeps token counts for this request (a penalty is on)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def is_constrained(self) -> bool:
        """Whether each token is drawn under a per-sequence mask (structured outputs, or
        allowed_token_ids): the engine defers such rows' draw (docs/ARCHITECTURE.md). Bad
        words of more than one token are masked too: the engine marks those sequences
        (Sequence.is_constrained), since only the tokenizer knows the words' lengths."""
        return self.structured is not None or self.allowed_token_ids is not None

    @classmethod
    def from_dict(cls, values: dict, defaults: dict | None = None) -> "SamplingParams":
        """Build from user data (a JSON request), with the model's defaults underneath."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"unknown sampling field {unknown[0]!r}; known fields: "
                               f"{', '.join(sorted(known))}")
        merged = {k: v for k, v in (defaults or {}).items() if k in MODEL_DEFAULT_FIELDS}
        merged.update(values)
        return cls(**merged)


def _as_float(value):
    """A real number as a float where it is one (validate checks the rest: a bool, a
    string, an int past float's range stay what they are)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _token_key(key):
    """A logit_bias key as a token id where it spells one ("50256" -> 50256)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    return key


def _preview(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def model_samples(generation_config: dict) -> bool:
    """Whether generation_config.json asks to sample: as in transformers, only when it says
    `do_sample: true`; otherwise (no file, or no do_sample) the model decodes greedily.
    ConfigError for a do_sample that is no boolean (the string "false" would be true)."""
    value = generation_config.get("do_sample")
    if value is None:  # null: left out, as for every other field
        return False
    if as_flag(value) is None:
        shown = json.dumps(value) if isinstance(value, (str, int, float)) else _preview(value)
        raise ConfigError(f"generation_config.json: do_sample must be true or false, got "
                          f"{shown}; fix the file")
    return as_flag(value)


def generation_defaults(generation_config: dict) -> dict:
    """generation_config.json's sampling fields (GENERATION_DEFAULT_FIELDS), checked: the
    engine checks them when the model loads rather than blaming the first request that
    takes them. Without do_sample: true they only matter to a request that asks to sample;
    as in transformers, one that is invalid is then left out instead of refusing the model
    (ConfigError when the model samples)."""
    samples = model_samples(generation_config)
    defaults = {k: generation_config[k] for k in GENERATION_DEFAULT_FIELDS
                if generation_config.get(k) is not None}
    for name in list(defaults):
        try:
            SamplingParams(**{name: defaults[name]})
        except RequestError as e:
            if samples:
                raise ConfigError(f"generation_config.json: {e}; fix or remove the file") from None
            del defaults[name]
    return defaults


def model_max_tokens(generation_config: dict) -> int | None:
    """generation_config.json's max_new_tokens: the output length of a request that names
    none (vLLM reads it so; transformers' max_length, a total, is left out as vLLM does).
    ConfigError for one that is no integer >= 1."""
    value = generation_config.get("max_new_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"generation_config.json: max_new_tokens must be an integer >= 1, "
                          f"got {_preview(value)}; fix or remove it")
    return value


def model_sampling_defaults(generation_config: dict) -> dict:
    """generation_config.json's sampling fields as SamplingParams values, temperature 0
    (greedy) unless the model samples (model_samples), and max_tokens where it sets
    max_new_tokens."""
    defaults = generation_defaults(generation_config)
    if not model_samples(generation_config):
        defaults["temperature"] = 0.0
    max_tokens = model_max_tokens(generation_config)
    if max_tokens is not None:
        defaults["max_tokens"] = max_tokens
    return defaults

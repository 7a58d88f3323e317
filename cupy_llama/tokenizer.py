"""Text <-> token ids: tokenizer.json through `tokenizers`, the chat template rendered in a
jinja2 sandbox, and an incremental detokenizer for streaming.

Prompt safety: in `encode_chat` only the template's own text may produce special tokens.
Special-token spellings inside message fields and tool definitions (strings nested at any
depth: tool calls' arguments too) are broken with an invisible marker before rendering, so
the rendered prompt's special tokens all come from the template; the text between them is
then encoded with special-token parsing off (and the marker removed).
"""
from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from .errors import RequestError, TokenizerError

# A vocabulary with these three tokens speaks the Llama 3 chat format.
LLAMA3_FORMAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Tokens that end an assistant turn in common chat formats; each one the chat template
# writes joins the EOS set.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")


@dataclass(frozen=True)
class FimFormat:
    """A family's fill-in-the-middle tokens, as its tokenizer spells them. The prompt is
    prefix-suffix-middle: [leading specials] PREFIX prefix SUFFIX suffix MIDDLE, or with
    suffix_first: [leading specials] SUFFIX suffix PREFIX prefix (no middle token: the
    middle follows the prefix). The suffix is encoded without the implicit leading space
    a SentencePiece-style tokenizer puts before a text (CodeLlama's and mistral-common's
    encode_infilling); the prefix keeps it. `ends`: tokens that close a middle beside EOS,
    where the vocabulary has them."""
    name: str
    prefix: str
    suffix: str
    middle: str | None
    suffix_first: bool = False
    ends: tuple[str, ...] = ()


# Known fill-in-the-middle token sets, tried in order; a vocabulary holding all of one
# format's tokens uses it.
FIM_FORMATS = (
    # Qwen2.5-Coder, CodeGemma
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              ends=("<|fim_pad|>", "<|file_sep|>", "<|file_separator|>", "<|endoftext|>")),
    # StarCoder, StarCoder2, Granite Code
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              ends=("<fim_pad>", "<file_sep>", "<|endoftext|>")),
    FimFormat("santacoder", "<fim-prefix>", "<fim-suffix>", "<fim-middle>",
              ends=("<fim-pad>", "<|endoftext|>")),
    FimFormat("deepseek_coder", "<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
              "<\uff5cfim\u2581end\uff5c>"),
    FimFormat("codellama", "\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", ends=("\u2581<EOT>",)),
    # Codestral (mistral-common's encode_fim)
    FimFormat("mistral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
)
_NO_SPACE_MARK = "\u263a"  # encoded before a text and dropped: the text's implicit space goes

# The project's Llama 3 chat format, used when a Llama 3 model directory ships no template.
# For system/user/assistant messages it renders exactly like the Llama 3.1/3.2 Instruct
# template: BOS, a system header that always carries the knowledge-cutoff and date lines,
# then one header + trimmed content + <|eot_id|> per message.
LLAMA3_CHAT_TEMPLATE = r"""
{%- if tools is defined and tools is not none -%}
  {{- raise_exception("the built-in Llama 3 chat format does not support tools; put a chat_template.jinja that does into the model directory") -}}
{%- endif -%}
{%- if date_string is not defined -%}
  {%- set date_string = strftime_now("%d %b %Y") -%}
{%- endif -%}
{%- set system_text = "" -%}
{%- set turns = messages -%}
{%- if messages and messages[0]["role"] == "system" -%}
  {%- set system_text = messages[0]["content"] | trim -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{{- bos_token -}}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" -}}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " ~ date_string ~ "\n\n" -}}
{{- system_text ~ "<|eot_id|>" -}}
{%- for turn in turns -%}
  {%- if turn["role"] in ("tool", "ipython") -%}
    {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" ~ turn["content"] ~ "<|eot_id|>" -}}
  {%- else -%}
    {{- "<|start_header_id|>" ~ turn["role"] ~ "<|end_header_id|>\n\n" -}}
    {{- (turn["content"] | trim) ~ "<|eot_id|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}
{%- endif -%}
"""

# The conversation a chat template must render when the model loads (no system message:
# some templates refuse one, which only matters to the requests that send it).
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "Tell me a joke."})
# Formats tried when a pinned date_string must answer strftime_now(fmt) in another format.
_DATE_FORMATS = ("%d %b %Y", "%d %B %Y", "%Y-%m-%d", "%b %d %Y", "%B %d, %Y")
# Private-use characters that break a special-token spelling inside message text.
_MARKER_CANDIDATES = tuple(chr(c) for c in range(0xF8FF, 0xF8F0, -1))


class Tokenizer:
    """A model directory's tokenizer. Build it with `Tokenizer.from_dir(model_dir)`."""

    def __init__(self, backend: BackendTokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None, extra_eos: tuple[str, ...] = (),
                 add_bos: bool = False, template_tokens: dict | None = None,
                 tool_chat_template: str | None = None, named_templates: dict | None = None):
        """tool_chat_template: the template for chats that offer tools, where the model
        has one of its own (a "tool_use" template beside the default), else None.
        named_templates: tokenizer_config.json's list of {name, template} as a dict ({} for
        one template); a request may name one as its chat_template, as in transformers."""
        self._backend = backend
        # A copy that never matches special tokens in text: message content goes through it.
        self._plain = BackendTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        # and for text after the start of a chat prompt (past a special token): tokenizers
        # gives a Metaspace pre-tokenizer's "first" space only to text at offset 0
        self._plain_inner = _never_prepending(self._plain) or self._plain
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self._special = {tok.content: (i, tok) for i, tok in added.items() if tok.special}
        self._special_ids = frozenset(i for i, _ in self._special.values())
        self._special_pattern = _alternation(self._special)
        self.chat_template = chat_template
        self._compiled_template = None
        self.tool_chat_template = tool_chat_template
        self._compiled_tool_template = None
        self.named_templates = dict(named_templates or {})
        self._request_templates: dict = {}  # requests' own templates (_request_template)
        self._request_templates_lock = threading.Lock()
        self.bos_token = bos_token if self._id_of(bos_token) is not None else None
        self.eos_token = eos_token if self._id_of(eos_token) is not None else None
        self._add_bos = add_bos and self.bos_token is not None
        self._template_tokens = {k: v for k, v in (template_tokens or {}).items() if v}
        eos = {eos_token, *extra_eos}
        # the end-of-turn tokens of its template (or of its named ones, where none is default)
        templates = chat_template or "".join(self.named_templates.values())
        eos |= {t for t in END_OF_TURN_TOKENS if t in templates}
        self.eos_token_ids = tuple(sorted(i for i in map(self._id_of, eos) if i is not None))
        self._added_ids: frozenset | None = None  # added_token_ids: worked out on first use
        self._byte_level: bool | None = None
        self._strips_first_space: bool | None = None  # text_context: on first use

    # ---- loading ---------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir, config=None) -> "Tokenizer":
        """config: an optional ModelConfig, used for BOS/EOS when the tokenizer files
        do not name them."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer.json not found in {str(model_dir)!r}; copy the "
                                 "model's tokenizer.json into the model directory")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions with its reason
            raise TokenizerError(f"cannot read {str(path)!r} ({_first_line(e)}); re-download "
                                 "the model's tokenizer.json") from None
        tok_config = _read_tokenizer_config(model_dir / "tokenizer_config.json")
        template = _find_chat_template(model_dir, tok_config)
        is_llama3 = all(backend.token_to_id(t) is not None for t in LLAMA3_FORMAT_TOKENS)
        uses_llama3_defaults = is_llama3 and not tok_config
        if template is None and is_llama3 and not _named_templates(tok_config):
            template = LLAMA3_CHAT_TEMPLATE

        def config_token(token_id):
            return backend.id_to_token(token_id) if token_id is not None else None

        bos = _token_text(tok_config.get("bos_token"))
        eos = _token_text(tok_config.get("eos_token"))
        extra_eos: tuple[str, ...] = ()
        if uses_llama3_defaults:  # what the released Llama 3 Instruct tokenizer declares
            bos, eos, extra_eos = "<|begin_of_text|>", "<|eot_id|>", ("<|end_of_text|>",)
        if bos is None and config is not None:
            bos = config_token(config.bos_token_id)
        if eos is None and config is not None and config.eos_token_ids:
            eos = config_token(config.eos_token_ids[0])
        # BOS comes from tokenizer.json's post-processor as Hugging Face does; a tokenizer
        # whose post-processor adds none gets it here only when declared (add_bos_token) or
        # when it is a Llama 3 vocabulary without tokenizer_config.json.
        add_bos = uses_llama3_defaults or tok_config.get("add_bos_token") is True
        if add_bos and bos is not None:
            add_bos = not _post_processor_adds(backend, backend.token_to_id(bos))
        template_tokens = {name: _token_text(tok_config.get(name))
                           for name in ("unk_token", "pad_token")}
        return cls(backend, template, bos, eos, extra_eos, add_bos, template_tokens,
                   _find_tool_template(model_dir, tok_config), _named_templates(tok_config))

    # ---- vocabulary ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS token, by transformers' name (eos_token_ids holds every token
        that ends a reply: the end of turn too)."""
        return self._id_of(self.eos_token)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, _ in self._special.values())

    @property
    def added_token_ids(self) -> frozenset:
        """The ids of tokenizer.json's added tokens, special or not."""
        added = self._added_ids
        if added is None:
            added = self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
        return added

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def convert_tokens_to_ids(self, tokens):
        """transformers' name: a token's id (None where the vocabulary has no such token), or
        a list of them for a list of tokens, as in `stop_token_ids=[tok.eos_token_id,
        tok.convert_tokens_to_ids("<|eot_id|>")]`."""
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(token) for token in tokens]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own, as OpenAI's logprobs give them (a
        token may hold part of a character, which its decoded text cannot show): a
        byte-level vocabulary's token through GPT-2's byte alphabet, a SentencePiece byte
        token (<0xC3>) its byte, another piece its text with "▁" as a space, a special
        token its text. Nothing for an id past the vocabulary."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.added_token_ids:
            return token.encode()
        if self._byte_level is None:
            self._byte_level = _decoder_kinds(self._backend) & {"ByteLevel"} != set()
        if self._byte_level:
            alphabet = _byte_alphabet()
            if all(ch in alphabet for ch in token):
                return bytes(alphabet[ch] for ch in token)
            return token.encode()
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if byte:
            return bytes([int(byte[1], 16)])
        return token.replace("\u2581", " ").encode()

    def to_json(self) -> str:
        """tokenizer.json as the tokenizers library holds it, without padding or
        truncation (what llguidance builds its token trie from)."""
        backend = self._backend
        if backend.padding is not None or backend.truncation is not None:
            backend = BackendTokenizer.from_str(backend.to_str())
            backend.no_padding()
            backend.no_truncation()
        return backend.to_str()

    # ---- encode / decode -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        """Token ids of a plain prompt, as Hugging Face's tokenizer gives them.
        split_special_tokens=True reads special-token spellings as ordinary text."""
        if not isinstance(text, str):
            raise RequestError(f"prompt must be a string, got {type(text).__name__}")
        check_unicode(text, "the prompt")
        backend = self._plain if split_special_tokens else self._backend
        ids = _encode(backend, text, add_special_tokens)
        if add_special_tokens and self._add_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        for token_id in ids:
            if not (isinstance(token_id, int) and 0 <= token_id < self._vocab_size):
                raise RequestError(f"token id {token_id!r} is outside the vocabulary "
                                   f"(0..{self._vocab_size - 1})")
        return self.decode_unchecked(ids, skip_special_tokens)

    def decode_unchecked(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """decode() for ids known to be in the vocabulary (the engine's own sampled ids):
        no per-id checks, which cost as much as decoding a few ids."""
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_context(self, prompt_ids) -> list[int]:
        """The prompt's last tokens that an output's text is decoded after, so that its
        first token keeps the space it starts with. Only a decoder that drops the first
        space of a text (SentencePiece's Strip: Llama 2's and Mistral's vocabularies) needs
        them: up to CONTEXT_TOKENS prompt tokens after the prompt's last special token (a
        reply after a chat template's closing token is a text of its own, as transformers
        decodes it; a completion continues its prompt, " Paris" after "... France is", as
        vLLM decodes it). None for other decoders."""
        strips = self._strips_first_space
        if strips is None:
            strips = self._strips_first_space = "Strip" in _decoder_kinds(self._backend)
        if not strips:
            return []
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        for at in range(len(tail) - 1, -1, -1):
            if tail[at] in self._special_ids:
                return tail[at + 1:]
        return tail

    # ---- fill-in-the-middle -----------------------------------------------------------

    @property
    def fim_format(self) -> FimFormat | None:
        """The first of FIM_FORMATS whose tokens this vocabulary holds, or None."""
        for fim in FIM_FORMATS:
            tokens = (fim.prefix, fim.suffix) + ((fim.middle,) if fim.middle else ())
            if all(self._id_of(token) is not None for token in tokens):
                return fim
        return None

    @property
    def fim_end_token_ids(self) -> list[int]:
        """The tokens besides EOS that end a middle (the format's `ends` found here)."""
        fim = self.fim_format
        ids = [self._id_of(token) for token in fim.ends] if fim else []
        return sorted({i for i in ids if i is not None} - set(self.eos_token_ids))

    def encode_fim(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt of the text before (prefix) and after (suffix) a
        gap, in this vocabulary's format: what the model completes is the middle.
        RequestError where the vocabulary has no known FIM tokens."""
        fim = self.fim_format
        if fim is None:
            raise RequestError("this model has no fill-in-the-middle tokens (its tokenizer "
                               "has none of the known sets, such as <|fim_prefix|>, "
                               "<fim_prefix>, <PRE> or [SUFFIX]); send the prompt alone")
        for text, what in ((prefix, "prefix"), (suffix, "suffix")):
            if not isinstance(text, str):
                raise RequestError(f"the {what} must be a string, got {type(text).__name__}")
        before = self._leading_special_ids()
        prefix_ids = self.encode(prefix, add_special_tokens=False) if prefix else []
        suffix_ids = self._encode_infilling(suffix)
        if fim.suffix_first:
            return (before + [self._id_of(fim.suffix)] + suffix_ids
                    + [self._id_of(fim.prefix)] + prefix_ids)
        return (before + [self._id_of(fim.prefix)] + prefix_ids + [self._id_of(fim.suffix)]
                + suffix_ids + [self._id_of(fim.middle)])

    def _leading_special_ids(self) -> list[int]:
        """What encode() puts before a text's own tokens (BOS, where the tokenizer adds
        one)."""
        bare = self.encode("a", add_special_tokens=False)
        full = self.encode("a")
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start]
        return []

    def _encode_infilling(self, text: str) -> list[int]:
        """text's tokens without the implicit leading space of a SentencePiece-style
        tokenizer (which spells "a" as "\u2581a"): encoded after a mark whose tokens are
        dropped. Byte-level tokenizers put no space there and encode text as it is."""
        if not text:
            return []
        plain = self.encode(text, add_special_tokens=False)
        first = self.encode("a", add_special_tokens=False)
        if not first or not (self.id_to_token(first[0]) or "").startswith("\u2581"):
            return plain
        mark = self.encode(_NO_SPACE_MARK, add_special_tokens=False)
        marked = self.encode(_NO_SPACE_MARK + text, add_special_tokens=False)
        return marked[len(mark):] if marked[:len(mark)] == mark else plain

    # ---- chat ------------------------------------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            date_string: str | None = None, tools=None,
                            template_kwargs: dict | None = None,
                            continue_final_message: bool = False,
                            chat_template: str | None = None, tokenize: bool = False,
                            **more_template_kwargs) -> str | list[int]:
        """The prompt text the model's chat template renders for these messages.
        template_kwargs: more variables for the template (Qwen3's enable_thinking, say), as
        transformers' apply_chat_template takes them (its keyword arguments too: `...,
        enable_thinking=False`). continue_final_message: the text ends with the last
        message's content, left open for the model to continue (as in transformers; it
        excludes add_generation_prompt). chat_template: a Jinja template to render instead
        of the model's (vLLM's request field), in the same sandbox; RequestError when it
        does not compile or render. tokenize=True: the prompt's ids (encode_chat) instead,
        for scripts written against transformers' tokenizer."""
        if more_template_kwargs:
            template_kwargs = {**(template_kwargs or {}), **more_template_kwargs}
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt, date_string, tools,
                                    template_kwargs, continue_final_message, chat_template)
        messages = validate_messages(messages)
        text = self._render(messages, add_generation_prompt, date_string, tools,
                            template_kwargs, chat_template)
        return _continue_final(text, messages, add_generation_prompt) \
            if continue_final_message else text

    def encode_chat(self, messages, add_generation_prompt: bool = True,
                    date_string: str | None = None, tools=None,
                    template_kwargs: dict | None = None,
                    continue_final_message: bool = False,
                    chat_template: str | None = None) -> list[int]:
        """Prompt ids for a chat; special tokens come only from the template's own text.
        continue_final_message and chat_template as in apply_chat_template."""
        messages = validate_messages(messages)
        marker = _pick_marker([messages, tools])
        guarded = self._guard(messages, marker)
        if tools is not None:  # tool descriptions are the caller's text too
            tools = self._guard(tools, marker)
        text = self._render(guarded, add_generation_prompt, date_string, tools, template_kwargs,
                            chat_template)
        if continue_final_message:
            text = _continue_final(text, guarded, add_generation_prompt)
        ids: list[int] = []
        for k, (piece, special) in enumerate(self._split_on_specials(text)):
            if special is not None:
                ids.append(special)
            elif piece:
                plain = self._plain if k == 0 else self._plain_inner
                ids.extend(_encode(plain, piece.replace(marker, ""), False))
        return ids

    def _guard(self, value, marker: str):
        """A copy of value (messages, tools: dicts, lists and strings nested in any way)
        with every special-token spelling in its strings broken by the marker."""
        if isinstance(value, str):
            return self._break_specials(value, marker)
        if isinstance(value, dict):
            return {self._guard(k, marker): self._guard(v, marker) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._guard(item, marker) for item in value]
        return value

    def _break_specials(self, text: str, marker: str) -> str:
        if self._special_pattern is None:
            return text
        # repeat: breaking one spelling can never create another, but overlapping
        # spellings that the first pass skipped still need breaking
        while self._special_pattern.search(text):
            text = self._special_pattern.sub(lambda m: m[0][0] + marker + m[0][1:], text)
        return text

    def _split_on_specials(self, text: str):
        """Yield (text piece, None) and ("", special id) in order, as tokenizers splits."""
        if self._special_pattern is None:
            yield text, None
            return
        pieces = self._special_pattern.split(text)  # text, special, text, special, ..., text
        for k in range(1, len(pieces), 2):
            token = self._special[pieces[k]][1]
            if token.lstrip:
                pieces[k - 1] = pieces[k - 1].rstrip()
            if token.rstrip:
                pieces[k + 1] = pieces[k + 1].lstrip()
        for k, piece in enumerate(pieces):
            yield (piece, None) if k % 2 == 0 else ("", self._special[piece][0])

    def check_fits(self, model_vocab_size: int, model_dir) -> None:
        """TokenizerError where tokenizer.json's own vocabulary (its added tokens aside) has
        more tokens than the model's embeddings: it belongs to another model, and its ids
        past the model's would fail every prompt. Fewer is common (padded vocabularies)."""
        base = self._backend.get_vocab_size(with_added_tokens=False)
        if base > model_vocab_size:
            raise TokenizerError(
                f"tokenizer.json in {str(model_dir)!r} has {base} tokens but the model's "
                f"vocabulary (config.json vocab_size) has {model_vocab_size}: it is another "
                f"model's tokenizer; copy this model's tokenizer.json into the folder")

    @property
    def template_for_tools(self) -> str | None:
        """The template a chat that offers tools renders with (its tool-call format is the
        one replies are parsed in)."""
        return self.tool_chat_template or self.chat_template

    def tools_template(self, chat_template: str | None = None) -> str | None:
        """The text of the template a chat that offers tools renders with: chat_template
        (the name of one of the model's named templates, or a template's text) where given,
        else template_for_tools."""
        if chat_template is None:
            return self.template_for_tools
        return self.named_templates.get(chat_template, chat_template)

    def tools_refusal(self, tools, chat_template: str | None = None,
                      template_kwargs: dict | None = None) -> str | None:
        """The chat template's own error where a short chat that offers these tools fails to
        render and the same chat without them renders (the built-in Llama 3 format refuses
        tools): it tells a user more than "no tool-call format known" would. None where
        the tools render, or where the template fails either way."""
        hello = [{"role": "user", "content": "hello"}]
        try:
            self.apply_chat_template(hello, tools=tools, template_kwargs=template_kwargs,
                                     chat_template=chat_template)
            return None
        except (TokenizerError, RequestError) as e:
            refusal = str(e)
        try:
            self.apply_chat_template(hello, template_kwargs=template_kwargs,
                                     chat_template=chat_template)
        except (TokenizerError, RequestError):
            return None
        return refusal

    def check_chat_template(self) -> None:
        """Compile the chat template and render it once on a short conversation, so that a
        broken template (bad syntax, an error when it runs, a reach out of the sandbox) is
        an error when the model loads, not at its first chat message. No template is fine
        here: plain prompts need none."""
        for template in self.named_templates.values():  # a chat may name any of them
            _compile_template(template)  # names the syntax error
        if self.chat_template is None:
            return
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)  # names the syntax error
        if self.tool_chat_template is not None and self._compiled_tool_template is None:
            self._compiled_tool_template = _compile_template(self.tool_chat_template)
        try:
            self._render(list(PROBE_CONVERSATION), True, "26 Jul 2024", None, None)
        except TokenizerError as e:
            reason = str(e).split("; check ")[0]
            for prefix in ("chat template failed to render: ", "chat template: "):
                reason = reason.removeprefix(prefix)
            raise TokenizerError(f"the model's chat template fails on a short conversation "
                                 f"({reason}); fix it or remove it (chat_template.jinja, or "
                                 "chat_template in tokenizer_config.json)") from None

    def _render(self, messages, add_generation_prompt, date_string, tools,
                template_kwargs, chat_template: str | None = None) -> str:
        if chat_template is not None:
            compiled = self._request_template(chat_template)
        elif self.chat_template is None:
            raise TokenizerError(self.no_template_reason())
        elif tools is not None and self.tool_chat_template is not None:
            if self._compiled_tool_template is None:
                self._compiled_tool_template = _compile_template(self.tool_chat_template)
            compiled = self._compiled_tool_template
        else:
            if self._compiled_template is None:
                self._compiled_template = _compile_template(self.chat_template)
            compiled = self._compiled_template
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         **self._template_tokens)
        variables.update(check_template_kwargs(template_kwargs))
        if tools is not None:
            variables["tools"] = tools
        if date_string is not None:
            variables["date_string"] = date_string
        variables["strftime_now"] = _strftime_now(date_string)
        try:
            return compiled.render(**variables)
        except RequestError:
            raise
        except TokenizerError as e:  # the template's raise_exception
            if chat_template is None:
                raise
            raise RequestError(f"chat_template: {str(e).removeprefix('chat template: ')}") \
                from None
        except Exception as e:  # the template is the model's code: any failure is its own
            if isinstance(e, (TypeError, jinja2.UndefinedError)) and any(
                    _no_call_text(m) for m in messages):
                # a template that knows no tool calls (one a tool-call parser serves) joins
                # every content as text: the calls' messages as "", as vLLM hands them over
                # (templates that know calls may test for None, so it goes first)
                variables["messages"] = [{**m, "content": ""} if _no_call_text(m) else m
                                         for m in messages]
                try:
                    return compiled.render(**variables)
                except Exception:  # noqa: BLE001 (the first failure is the one to name)
                    pass
            reason = _first_line(e)
            if not isinstance(e, jinja2.TemplateError):
                reason = f"{type(e).__name__}: {reason}"
            if chat_template is not None:
                raise RequestError(f"chat_template failed to render: {reason}; check the "
                                   "messages or the chat_template") from None
            raise TokenizerError(f"chat template failed to render: {reason}; "
                                 "check the messages or the model's chat template") from None

    def no_template_reason(self) -> str:
        """Why a chat that names no template cannot render, and the ways out."""
        if self.named_templates:
            names = ", ".join(repr(name) for name in self.named_templates)
            return (f"this model's tokenizer_config.json lists chat templates ({names}) but "
                    f"none named 'default'; pass one of those names as chat_template, add "
                    f"chat_template.jinja to the model folder, or send plain prompts")
        return ("this model has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); add one, or send plain prompts "
                "instead of chat messages")

    def _request_template(self, source) -> "jinja2.Template":
        """A request's own chat template, or the name of one of the model's
        (named_templates), compiled (the last few are kept)."""
        if not isinstance(source, str):
            raise RequestError(f"chat_template must be a string (a Jinja template), got "
                               f"{type(source).__name__}")
        cache = self._request_templates
        with self._request_templates_lock:  # the server renders in worker threads
            compiled = cache.pop(source, None)
        if compiled is None and source in self.named_templates:
            compiled = _compile_template(self.named_templates[source])
        elif compiled is None:
            compiled = _compile_template(source, from_request=True)
        with self._request_templates_lock:
            cache[source] = compiled  # most recently used last
            while len(cache) > REQUEST_TEMPLATE_CACHE:
                del cache[next(iter(cache))]
        return compiled


CONTEXT_TOKENS = 4  # tokens decoded before the new ones, for the spaces a decode drops


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas. Decodes only a short window of recent
    ids: `prefix_offset..read_offset` is text already emitted, used as context so that
    tokenizers which drop a leading space at the start of a decode stay exact. With
    checked=False it runs the same window in Rust, in one call per token (tokenizers'
    DecodeStream, where the installed tokenizers has it)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 checked: bool = True, context: list[int] = ()):
        """checked=False: the ids are known to be in the vocabulary; skip decode()'s checks.
        context: tokens the text comes after, whose own text is not given
        (Tokenizer.text_context)."""
        self._decode = tokenizer.decode if checked else tokenizer.decode_unchecked
        self._skip = skip_special_tokens
        self.token_ids: list[int] = list(context)  # the context's, then the added ones
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stream = None if checked else _decode_stream(tokenizer, skip_special_tokens)
        self._num_chars = 0    # text emitted so far (the stream's)
        self._holding = False  # the stream's last token emitted nothing: it may hold bytes
        self._num_emitted = len(context)  # tokens whose text the stream has emitted, all of it
        if context and self._stream is not None:
            self._read_context()

    def _read_context(self) -> None:
        """Step the stream through the context, its text not given; where the stream
        cannot take it, the window decodes it as context."""
        stream, backend = self._stream
        try:
            for token_id in self.token_ids:
                self._num_chars += len(stream.step(backend, token_id) or "")
        except Exception:  # noqa: BLE001 (lone bytes: see add)
            self._stream = None
            self._num_chars = 0
            return
        # a context that ends inside a character would hold bytes: flush decodes whole
        self._holding = True

    def add(self, token_id: int) -> str:
        """Text newly completed by this token ('' while a character is still partial)."""
        self.token_ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                text = stream[0].step(stream[1], token_id)
            except Exception:  # noqa: BLE001 (the Rust side raises plain Exceptions)
                # bytes that are no UTF-8 prefix (a byte-fallback vocabulary's lone bytes:
                # "Invalid prefix encountered"): the window below goes on from the tokens
                # not emitted yet, where a broken character decodes as U+FFFD
                self._stream = None
                self._read_offset = self._num_emitted
                self._prefix_offset = max(0, self._num_emitted - CONTEXT_TOKENS)
                return self.add_to_window()
            if text:
                self._num_chars += len(text)
                self._holding = False
                self._num_emitted = len(self.token_ids)
                return text
            self._holding = True
            return ""
        return self.add_to_window()

    def add_to_window(self) -> str:
        """The window's text newly completed by the last token added."""
        decode = self._decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self.token_ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or the last character's bytes are not all here yet
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever was held back (an incomplete character decodes as U+FFFD here)."""
        if self._stream is not None:
            if not self._holding:
                return ""  # the last token's text came out whole: nothing is held
            self._holding = False
            text = self._decode(self.token_ids, self._skip)  # once, at the end
            tail, self._num_chars = text[self._num_chars:], len(text)
            return tail
        decode = self._decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self.token_ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]


def _decode_stream(tokenizer: Tokenizer, skip_special_tokens: bool):
    """(tokenizers' DecodeStream, the backend it decodes with), or None where the
    installed tokenizers has none (before 0.21)."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    backend = getattr(tokenizer, "_backend", None)
    if not isinstance(backend, BackendTokenizer):
        return None  # a stand-in with decode() only
    return DecodeStream(skip_special_tokens=skip_special_tokens), backend


def validate_messages(messages) -> list[dict]:
    """A chat: a non-empty list of {"role": str, "content": str, ...} dicts, as OpenAI's chat
    API writes them (a content of text parts is joined into one string). An assistant message may carry "tool_calls" ([{"id", "type":
    "function", "function": {"name", "arguments"}}]), its content then null or left out; a
    "tool" message answers a call ("tool_call_id"). Other keys pass to the template as
    they are. Tool-call arguments sent as JSON text (OpenAI's form) reach the template as
    the object they hold: chat templates write them with tojson, as transformers documents
    them. Returns the messages, copied where they changed."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise RequestError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                           f"got {type(messages).__name__}")
    if not messages:
        raise RequestError("messages is empty; send at least one {'role': 'user', "
                           "'content': ...} message")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be a dict with 'role' and 'content', "
                               f"got {type(message).__name__}")
        if "role" not in message:
            raise RequestError(f"{where} has no 'role'")
        if not isinstance(message["role"], str):
            raise RequestError(f"{where}['role'] must be a string, got "
                               f"{type(message['role']).__name__}")
        check_unicode(message["role"], f"{where}['role']")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if message["role"] != "assistant":
                raise RequestError(f"{where} has tool_calls but its role is "
                                   f"{message['role']!r}; only assistant messages call tools")
            tool_calls = _check_tool_calls(tool_calls, f"{where}['tool_calls']")
        content = message.get("content")
        if isinstance(content, (list, tuple)):  # OpenAI's parts: their texts, one a line
            content = text_of_parts(content, f"{where}['content']", message["role"])
            message = {**message, "content": content}
        if not (tool_calls and content is None):  # a message of tool calls needs no text
            if "content" not in message:
                raise RequestError(f"{where} has no 'content'")
            if not isinstance(content, str):
                raise RequestError(f"{where}['content'] must be a string, got "
                                   f"{type(content).__name__}")
            check_unicode(content, f"{where}['content']")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise RequestError(f"{where}['tool_call_id'] must be a string, got "
                               f"{type(message['tool_call_id']).__name__}")
        if tool_calls is not None:
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            if tool_calls:  # an empty list is no call at all
                message["tool_calls"] = tool_calls
        checked.append(message)
    return checked


def _no_call_text(message: dict) -> bool:
    """An assistant message of tool calls whose content is null or left out."""
    return bool(message.get("tool_calls")) and message.get("content") is None


def part_text_key(kind, role: str | None) -> str:
    """The field that holds a content part's text, by the part's type and the message's
    role: an assistant's "refusal" part (OpenAI's, as vLLM reads it) keeps it under
    "refusal", every other part is read as {"type": "text", "text": ...}."""
    return "refusal" if kind == "refusal" and role == "assistant" else "text"


def text_of_parts(parts, where: str, role: str | None = None) -> str:
    """[{"type": "text", "text": ...}, ...] (OpenAI's content parts) as one text, the parts
    joined by newlines (as the server joins them), an assistant's {"type": "refusal",
    "refusal": ...} parts among them; RequestError naming `where` otherwise."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = part_text_key(kind, role)
        if not (isinstance(part, dict) and kind == key):
            shape = ("{'type': 'text', 'text': ...} or {'type': 'refusal', 'refusal': ...}"
                     if role == "assistant" else "{'type': 'text', 'text': ...}")
            raise RequestError(f"{where}[{j}] must be {shape} (got {kind!r}): only text "
                               f"content is supported")
        if not isinstance(part.get(key), str):
            raise RequestError(f"{where}[{j}]['{key}'] must be a string")
        texts.append(part[key])
    return "\n".join(texts)


def _check_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls, their JSON-text arguments decoded."""
    shape = "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
    if isinstance(calls, (str, bytes)) or not isinstance(calls, (list, tuple)):
        raise RequestError(f"{where} must be a list of {shape}, got {type(calls).__name__}")
    decoded = []
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f"{here} must be {shape}")
        function = call["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{here}['function']['name'] must be a non-empty string")
        for key in ("id", "type"):
            if call.get(key) is not None and not isinstance(call[key], str):
                raise RequestError(f"{here}['{key}'] must be a string")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None  # not JSON: the template gets the text as it is
            if isinstance(parsed, dict):
                arguments = parsed
        elif not isinstance(arguments, dict):
            raise RequestError(f"{here}['function']['arguments'] must be a JSON object or "
                               f"its text, got {type(arguments).__name__}")
        for text in _strings_in([call, arguments]):
            check_unicode(text, f"{here}['function']")
        decoded.append({**call, "function": {**function, "arguments": arguments}})
    return decoded


REQUEST_TEMPLATE_CACHE = 16  # requests' own chat templates kept compiled

# variables the renderer sets itself: a request's chat-template keyword arguments may not
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token",
                               "tools", "date_string", "strftime_now", "raise_exception")


def check_template_kwargs(template_kwargs) -> dict:
    """A request's extra chat-template variables: a dict of names the renderer does not set
    itself (RequestError otherwise)."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict) or not all(
            isinstance(key, str) and key.isidentifier() for key in template_kwargs):
        raise RequestError("chat_template_kwargs must be an object whose keys are names, such "
                           "as {\"enable_thinking\": false}")
    reserved = sorted(set(template_kwargs) & set(RESERVED_TEMPLATE_VARIABLES))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {reserved[0]!r}: the chat "
                           "template gets it from the request itself")
    return template_kwargs


def check_unicode(text: str, what: str) -> None:
    """Text must be valid Unicode (no lone surrogates, as undecodable input bytes become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid text: character {e.start} is "
                           f"{text[e.start]!r}, which is not valid Unicode (is the input "
                           f"UTF-8?)") from None


def _continue_final(text: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """The rendered chat cut right after the last message's content, as transformers'
    continue_final_message does (trailing spaces the template trimmed stay trimmed)."""
    if add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be "
                           "true; continuing the last message adds no generation prompt")
    final = messages[-1].get("content")
    if not isinstance(final, str) or not final.strip():  # (tool calls carry no content)
        raise RequestError("continue_final_message: the last message is empty, so there is "
                           "nothing to continue; send add_generation_prompt instead")
    at = text.rfind(final.strip())
    if at < 0:
        raise RequestError("continue_final_message: the last message's content does not "
                           "appear in the rendered chat (the chat template leaves it out)")
    end = at + len(final.lstrip())
    if text[at:end] != final:  # the template trimmed space around it
        end = at + len(final.strip())
    return text[:end]


# a text this long is encoded with the interpreter lock released (encode_batch lets it go,
# encode keeps it), so that a server's other threads run meanwhile
_LONG_TEXT = 4096


def _never_prepending(backend: BackendTokenizer) -> BackendTokenizer | None:
    """A copy of a tokenizer whose Metaspace pre-tokenizer prepends its space to the first
    text only (prepend_scheme "first") that prepends it nowhere, or None for another
    tokenizer (its pieces encode the same wherever they are). Which it is comes from the
    pre-tokenizer's own JSON: the whole tokenizer.json is written only for such a copy."""
    pre = backend.pre_tokenizer
    if pre is None or not _first_only_metaspaces(json.loads(pre.__getstate__())):
        return None
    config = json.loads(backend.to_str())
    for part in _first_only_metaspaces(config.get("pre_tokenizer")):
        part["prepend_scheme"] = "never"
    inner = BackendTokenizer.from_str(json.dumps(config))
    inner.encode_special_tokens = True
    return inner


def _first_only_metaspaces(pre_tokenizer) -> list[dict]:
    """The Metaspace parts of a pre-tokenizer's JSON (a Sequence's too) that prepend their
    space to the first text only."""
    found, stack = [], [pre_tokenizer]
    while stack:
        part = stack.pop()
        if not isinstance(part, dict):
            continue
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") == "first":
            found.append(part)
        stack += part.get("pretokenizers") or []
    return found


def _encode(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < _LONG_TEXT:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


# ---- chat template environment (what transformers provides when it renders) -------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering just writes the body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise TokenizerError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(date_string: str | None):
    """strftime_now for the template; a pinned date_string fixes the date it reports."""
    if date_string is None:
        return lambda fmt: datetime.now().strftime(fmt)
    for date_format in _DATE_FORMATS:
        try:
            pinned = datetime.strptime(date_string, date_format)
        except ValueError:
            continue
        return pinned.strftime
    return lambda fmt: date_string


def _compile_template(source: str, from_request: bool = False):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        if from_request:
            raise RequestError(f"chat_template is not valid jinja ({_first_line(e)}); fix it "
                               "or leave it out to use the model's") from None
        raise TokenizerError(f"the chat template is not valid jinja ({_first_line(e)}); "
                             "fix or remove the model's chat template") from None


# ---- helpers -----------------------------------------------------------------------------

def _alternation(tokens) -> re.Pattern | None:
    """Regex matching any of the tokens, longest first (leftmost-longest, as tokenizers)."""
    if not tokens:
        return None
    alternatives = sorted(tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")


def _pick_marker(values) -> str:
    texts = list(_strings_in(values))
    for marker in _MARKER_CANDIDATES:
        if not any(marker in text for text in texts):
            return marker
    raise RequestError("messages contain every private-use character U+F8F1..U+F8FF; "
                       "remove them from the message text")


def _strings_in(value):
    """Every string in nested dicts (keys too) and lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings_in(key)
            yield from _strings_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings_in(item)


def _post_processor_adds(backend: BackendTokenizer, bos_id: int | None) -> bool:
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(without) and with_special[0] == bos_id


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path.name} is not valid JSON ({e}); re-download it or "
                             "delete it") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name} must hold a JSON object; re-download it")
    return data


def _find_chat_template(model_dir: Path, tok_config: dict) -> str | None:
    jinja = _read_jinja(model_dir / "chat_template.jinja")
    if jinja is not None:
        return jinja
    template = tok_config.get("chat_template")
    json_file = model_dir / "chat_template.json"  # image-text models' processors keep it here
    if template is None and json_file.is_file():
        template = _read_tokenizer_config(json_file).get("chat_template")
        if not isinstance(template, str):
            raise TokenizerError("chat_template.json must hold {\"chat_template\": \"...\"}; "
                                 "re-download it or delete it")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        # none named "default": chats name one (Tokenizer.named_templates), as in transformers
        return _named_templates(tok_config).get("default")
    raise TokenizerError("tokenizer_config.json: chat_template must be a string or a list "
                         "of {name, template}")


def _find_tool_template(model_dir: Path, tok_config: dict) -> str | None:
    """The model's template for chats that offer tools, as transformers picks it:
    additional_chat_templates/tool_use.jinja, or the "tool_use" entry of a list of named
    templates in tokenizer_config.json (NousResearch's Hermes models ship one)."""
    jinja = _read_jinja(model_dir / "additional_chat_templates" / "tool_use.jinja")
    if jinja is not None:
        return jinja
    return _named_templates(tok_config).get("tool_use")


def _read_jinja(path: Path) -> str | None:
    """A template file's text, or None where there is none."""
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{str(path)!r} is not UTF-8 text; fix or remove it") from None


def _named_templates(tok_config: dict) -> dict:
    """tokenizer_config.json's list of {name, template} as {name: template} ({} where
    chat_template is no list)."""
    templates = tok_config.get("chat_template")
    if not isinstance(templates, list):
        return {}
    return {t["name"]: t["template"] for t in templates if isinstance(t, dict)
            and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _decoder_kinds(backend: BackendTokenizer) -> set[str]:
    """The types of tokenizer.json's decoder and of the decoders it chains, read from the
    decoder's own JSON: the whole tokenizer's, for a vocabulary of 128k tokens, takes
    about 0.3 s to write and parse, and a first request would wait for it."""
    decoder = backend.decoder
    decoder = {} if decoder is None else json.loads(decoder.__getstate__())
    kinds, stack = set(), [decoder]
    while stack:
        part = stack.pop()
        if isinstance(part, dict):
            kinds.add(part.get("type"))
            stack += part.get("decoders") or []
    return kinds


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

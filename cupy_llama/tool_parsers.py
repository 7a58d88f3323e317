"""Tool calls in a model's reply: turn its text into OpenAI tool_calls (an id, type
"function", the function's name, its arguments as JSON text), whole or as it streams, for
the formats tool-calling families are trained to write:

- "llama3_json" (Llama 3.x): a JSON object {"name": ..., "parameters": {...}} ("arguments"
  is taken too), optionally after <|python_tag|>; several are separated by ";".
- "hermes" (Hermes 2/3, Qwen 2.5/3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
- "mistral": [TOOL_CALLS] then a JSON list of {"name", "arguments"} objects (tokenizers
  up to v7), or per call [TOOL_CALLS]name[ARGS]{...}, with [CALL_ID]id before [ARGS] in v11
  (v11 and later). [TOOL_CALLS] is a special token: the reply must be decoded with special
  tokens kept (`ToolCallParser.keeps_special_tokens`).

Text around calls stays content. Whitespace between a call and its neighbours is dropped,
and content before and after a call is joined by a newline. A call must show its shape (a
name, and arguments that open as an object) before it counts as one; a call that never
does, or that breaks later (arguments that are not JSON, a reply cut off inside one), is
left as content, its text as written: parsing never raises.

One parser serves both ways: `parse_tool_calls` feeds a whole reply, a `ToolCallParser`
takes the text deltas of a stream and answers each with a `StreamDelta`: content that is
sure not to be part of a call, and OpenAI `delta.tool_calls` entries (index, id and name
first, then argument fragments). Raw call text never reaches a delta's content; text that
may still turn out to be a call waits. The deltas add up to the whole reply's parse, except
that a call that breaks after its name was streamed stays a call in the stream (with the
arguments sent so far) where the whole reply's parse turns it back into content.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from .errors import RequestError

PARSER_NAMES = ("llama3_json", "hermes", "mistral")
# the formats whose calls start at a special token ([TOOL_CALLS]): their replies' text
# keeps special tokens (skip_special_tokens false), so that the parser sees the tag in the
# same text stop strings cut (vLLM's Mistral parser asks for the same)
SPECIAL_TAG_PARSERS = frozenset({"mistral"})
_ALPHANUMERIC = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"
# keys a call object may show before its name and arguments: anything else, before the
# call has shown its shape, means the object is not a call. (An "id" the model writes in
# the object is not used: it may come after the arguments, when a stream has long sent the
# call's id.)
_CALL_KEYS = ("name", "arguments", "parameters", "type", "id")
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def openai_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def mistral_call_id() -> str:
    """Mistral's chat format wants 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None  # None when there is no text besides the calls
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict:
        """The assistant message (finish_reason "tool_calls" when it holds calls)."""
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


@dataclass
class ToolCallDelta:
    """An OpenAI delta.tool_calls entry: the first for a call carries its id and name (and
    the start of its arguments, where the same delta has them)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        entry = {"index": self.index}
        if self.id is not None:
            entry.update(id=self.id, type="function",
                         function={"name": self.name, "arguments": self.arguments})
        else:
            entry["function"] = {"arguments": self.arguments}
        return entry


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self):
        return bool(self.content or self.tool_calls)

    def add(self, entry: ToolCallDelta) -> None:
        """Add a call's entry: its arguments join the entry this delta already holds for
        that call, so a delta never carries two entries of one index (OpenAI sends one,
        and a client reading tool_calls[0] would miss the rest)."""
        for held in self.tool_calls:
            if held.index == entry.index:
                if entry.id is not None and held.id is None:
                    held.id, held.name = entry.id, entry.name
                held.arguments += entry.arguments
                return
        self.tool_calls.append(entry)

    def extend(self, later: "StreamDelta") -> None:
        """Append what a later delta of the same sample adds (a stream's last piece)."""
        self.content += later.content
        for entry in later.tool_calls:
            self.add(entry)

    def to_openai(self) -> dict:
        """The chunk's delta: {"content": ...} and/or {"tool_calls": [...]} ({} when empty)."""
        delta = {}
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [entry.to_openai() for entry in self.tool_calls]
        return delta


# ---- choosing a parser -------------------------------------------------------------------

def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for, or None when it shows none."""
    if not chat_template:
        return None
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and (
            '"parameters"' in chat_template or "<|python_tag|>" in chat_template):
        return "llama3_json"
    return None


def check_parser_name(name: str, flag: str = "--tool-call-parser") -> str:
    if name not in PARSER_NAMES:
        raise RequestError(f"{flag}: unknown tool-call parser {name!r}; use one of "
                           f"{', '.join(PARSER_NAMES)}")
    return name


def make_tool_parser(name: str, make_id=None,
                     max_calls: int | None = None) -> "ToolCallParser":
    """A fresh parser for one reply. make_id: a function giving each call its id (by
    default a random one in the format's style); max_calls: the calls a reply may hold
    (1 for parallel_tool_calls false), the ones after them dropped, text and all."""
    check_parser_name(name)
    return _PARSERS[name](make_id, max_calls)


def parse_tool_calls(text: str, name: str, make_id=None,
                     max_calls: int | None = None) -> ParsedReply:
    """The tool calls in a whole reply and the content around them."""
    parser = make_tool_parser(name, make_id, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.result()


# ---- scanning JSON as it arrives ---------------------------------------------------------

class _JsonObject:
    """One JSON object in a growing text, scanned from its "{" as characters arrive: its
    top-level members are recorded as they complete (the first of a repeated key wins).
    Inside member values only strings and brackets are followed; the whole object is
    checked with json.loads when it closes."""
    KEY_OR_END, KEY_START, KEY, COLON, VALUE, STRING, NESTED, PRIMITIVE, AFTER = range(9)
    PRIMITIVE_CHARS = frozenset("0123456789+-.eEtruefalsn")

    def __init__(self, start: int):
        self.start = start
        self.pos = start + 1
        self.state = self.KEY_OR_END
        self.members: dict[str, tuple[int, int]] = {}
        self.keys: list[str] = []  # in order, as they complete
        self.key = None            # the key whose value is being scanned
        self.value_start = -1
        self._key_start = -1
        self._depth = 0
        self._in_string = self._escape = False
        self.end = -1              # index after "}" once complete
        self.failed = False
        self._event = False

    @property
    def complete(self) -> bool:
        return self.end >= 0

    def value(self, key: str, text: str) -> tuple[str, bool] | None:
        """A member's text so far and whether it is complete; None before it starts."""
        if key in self.members:
            start, end = self.members[key]
            return text[start:end], True
        if self.key == key and self.value_start >= 0:
            return text[self.value_start:self.pos], False
        return None

    def scan(self, text: str, pause: bool = False) -> bool:
        """Scan what has arrived. pause: stop after a key completes, a value opens or a
        member closes (so that a caller sees the object as it was at that point, however
        the text was cut into pieces); returns whether it stopped there."""
        i, n = self.pos, len(text)
        self._event = False
        while i < n and not (self.failed or self.complete or (pause and self._event)):
            c = text[i]
            state = self.state
            if state in (self.STRING, self.NESTED):
                if self._escape:
                    self._escape = False
                elif self._in_string:
                    if c == "\\":
                        self._escape = True
                    elif c == '"':
                        self._in_string = False
                        if state == self.STRING:
                            self._close_value(i + 1)
                elif c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._close_value(i + 1)
                i += 1
                continue
            if state == self.PRIMITIVE:
                if c in self.PRIMITIVE_CHARS:
                    i += 1
                else:
                    self._close_value(i)  # the character is looked at again, as AFTER
                continue
            if state == self.KEY:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    try:
                        self.key = json.loads(text[self._key_start:i + 1])
                    except json.JSONDecodeError:
                        self.failed = True
                    self.state, self._event = self.COLON, True
                i += 1
                continue
            i += 1
            if c in _WHITESPACE:
                continue
            if state in (self.KEY_OR_END, self.KEY_START) and c == '"':
                self._key_start, self.state = i - 1, self.KEY
            elif state == self.KEY_OR_END and c == "}" and not self.keys:
                self._finish(text, i)
            elif state == self.COLON and c == ":":
                self.state = self.VALUE
            elif state == self.VALUE and (c in "{[\"" or c in self.PRIMITIVE_CHARS):
                self.value_start, self._event = i - 1, True
                if c == '"':
                    self.state, self._in_string = self.STRING, True
                elif c in "{[":
                    self.state, self._depth = self.NESTED, 1
                else:
                    self.state = self.PRIMITIVE
            elif state == self.AFTER and c == ",":
                self.state = self.KEY_START
            elif state == self.AFTER and c == "}":
                self._finish(text, i)
            else:
                self.failed = True
        self.pos = i
        return self._event

    def _close_value(self, end: int) -> None:
        if self.key not in self.members:
            self.members[self.key] = (self.value_start, end)
        self.keys.append(self.key)
        self.key, self.value_start, self.state = None, -1, self.AFTER
        self._event = True

    def _finish(self, text: str, end: int) -> None:
        try:
            json.loads(text[self.start:end])
        except json.JSONDecodeError:
            self.failed = True
            return
        self.end = end


# ---- the parser --------------------------------------------------------------------------

class _Text:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class _Call:
    __slots__ = ("index", "call_id", "name", "arguments")

    def __init__(self, index: int, call_id: str, name: str):
        self.index = index
        self.call_id = call_id
        self.name = name
        self.arguments = ""  # its text so far


class _Region:
    """The text from an opener on that holds calls (one, or a list of them in Mistral's
    older form). Its calls count as calls once the first has shown its shape: a name, and
    arguments that open as an object. Formats scan it in stages (`stage`), `mark` being
    where the scanning goes on."""
    __slots__ = ("start", "opener", "mark", "stage", "scanner", "name", "call_id", "call",
                 "calls", "broken")

    def __init__(self, start: int, opener: str):
        self.start = start
        self.opener = opener
        self.mark = start + len(opener)
        self.stage = 0
        self.scanner: _JsonObject | None = None  # the object being scanned
        self.name: str | None = None             # the next call's, once complete
        self.call_id: str | None = None          # the next call's, when the model wrote one
        self.call: _Call | None = None           # the call whose arguments are coming
        self.calls: list[_Call] = []
        self.broken = False  # broke after a call was shown: the rest of the reply is its


class ToolCallParser:
    """One reply's tool calls, from text fed in pieces. feed() and finish() answer with
    what may be streamed; result() is the whole reply's parse once finish() was called.
    Formats say what opens a call (`openers`) and how to scan one (`_scan_region`)."""
    name = ""
    openers: tuple[str, ...] = ()
    # the reply must be decoded with its special tokens (skip_special_tokens=False): the
    # format's opener is one
    keeps_special_tokens = False

    def __init__(self, make_id=None, max_calls: int | None = None):
        self._make_id = make_id or openai_call_id
        self._max_calls = max_calls  # the calls kept (vLLM's parallel_tool_calls false: 1)
        self._text = ""
        self._scan = 0  # the text before this belongs to a segment
        self._segments: list[_Text | _Region] = []
        self._region: _Region | None = None  # the region being scanned
        self._calls: list[_Call] = []
        self._settled = ""      # the content of the settled text segments (_new_content)
        self._num_settled = 0   # segments settled
        self._num_sent = 0      # characters of content sent
        self._sent_arguments: list[str | None] = []
        self._finished = False

    # ---- feeding --------------------------------------------------------------------

    def feed(self, text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("the reply is finished")
        self._text += text
        self._advance(final=False)
        return self._delta(final=False)

    def finish(self) -> StreamDelta:
        """The reply is complete: decide what was waiting."""
        if not self._finished:
            self._finished = True
            self._advance(final=True)
        return self._delta(final=True)

    def result(self) -> ParsedReply:
        """The whole reply; the calls of a region that broke are content here."""
        if not self._finished:
            raise RuntimeError("result() comes after finish()")
        calls = [call for segment in self._segments if isinstance(segment, _Region)
                 and not segment.broken for call in segment.calls
                 if self._max_calls is None or call.index < self._max_calls]
        content = self._content(final=True, broken_as_text=True)
        return ParsedReply(content or None,
                           [ToolCall(c.call_id, c.name, c.arguments) for c in calls])

    # ---- scanning -------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            region = self._region
            if region is None:
                found = self._find_opener(text, self._scan)
                if found is None:
                    # all is text but an end that may begin an opener
                    keep = len(text) if final else len(text) - _opener_prefix(text, self.openers)
                    keep = max(keep, self._scan)
                    self._add_text(text[self._scan:keep])
                    self._scan = keep
                    return
                start, opener = found
                self._add_text(text[self._scan:start])
                region = self._region = _Region(start, opener)
                self._scan = start
            if region.broken:
                region.mark = len(text)  # it keeps the rest of the reply
                if not final:
                    return
                outcome = "done"
            else:
                outcome = self._scan_region(region, text, final)
                if outcome is None and final:
                    outcome = "fail"
                if outcome is None:
                    return
            if outcome == "fail" and not region.calls:
                # not a call after all: its opener is text, and scanning goes on after it
                self._add_text(region.opener)
                self._scan, self._region = region.start + len(region.opener), None
                continue
            if outcome == "fail":
                region.broken = True
                continue
            self._scan, self._region = region.mark, None

    def _find_opener(self, text: str, start: int) -> tuple[int, str] | None:
        best = None
        for opener in self.openers:
            at = text.find(opener, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, opener)
        return best

    def _add_text(self, text: str) -> None:
        if not text:
            return
        if self._segments and isinstance(self._segments[-1], _Text):
            self._segments[-1].text += text
        else:
            self._segments.append(_Text(text))

    def _show(self, region: _Region) -> _Call:
        """The region's next call has shown its shape: a call from now on."""
        call = _Call(len(self._calls), region.call_id or self._make_id(), region.name)
        if not region.calls:
            self._segments.append(region)
        region.calls.append(call)
        region.call, region.name, region.call_id = call, None, None
        self._calls.append(call)
        self._sent_arguments.append(None)
        return call

    def _scan_region(self, region: _Region, text: str, final: bool) -> str | None:
        """The format's part: scan on from region.mark. Returns None (more text is
        needed), "done" (region.mark is then where the text after it starts) or "fail"."""
        raise NotImplementedError

    def _scan_object_call(self, region: _Region, text: str) -> str | None:
        """A call written as one JSON object, {"name": ..., "arguments" | "parameters":
        {...}}, starting at region.mark after whitespace; region.mark goes past the object
        once it closes. None while it is open, else "done" or "fail"."""
        if region.scanner is None:
            at = _skip_whitespace(text, region.mark)
            if at == len(text):
                return None
            if text[at] != "{":
                return "fail"
            region.scanner = _JsonObject(at)
        scanner = region.scanner
        # until the call has shown its shape, look at the object after every key and
        # member, so that what it is decided at the same point however the text came
        while region.call is None and not scanner.failed and scanner.scan(text, pause=True):
            shape = self._check_shape(region, scanner, text)
            if shape == "fail":
                return "fail"
        if scanner.failed:
            return "fail"
        if region.call is None:
            if scanner.complete:
                return "fail"  # closed without showing a name and arguments
            return None
        scanner.scan(text)
        if scanner.failed:
            return "fail"
        region.call.arguments = _arguments_of(scanner, text)[0]
        if not scanner.complete:
            return None
        region.mark, region.scanner, region.call = scanner.end, None, None
        return "done"

    def _check_shape(self, region: _Region, scanner: _JsonObject, text: str) -> str | None:
        """Whether the object so far is a call: keys a call has only, a string name, and
        arguments that open as an object; shows it once both are there."""
        if any(key not in _CALL_KEYS for key in scanner.keys) or (
                scanner.key is not None and scanner.key not in _CALL_KEYS):
            return "fail"
        name = scanner.value("name", text)
        if name is not None and name[1] and region.name is None:
            region.name = _string_or_none(name[0])
            if region.name is None:
                return "fail"
        arguments = _arguments_of(scanner, text)
        if arguments is not None and not arguments[0].startswith("{"):
            return "fail"
        if region.name is not None and arguments is not None:
            self._show(region)
        return None

    # ---- what to send -----------------------------------------------------------------

    def _content(self, final: bool, broken_as_text: bool = False) -> str:
        """The content: text segments merged where nothing stands between them (a broken
        region is text in a whole parse), whitespace next to a call dropped, pieces on
        either side of calls joined by a newline. While the reply goes on, the last text's
        trailing whitespace waits (a call may follow)."""
        merged: list = []
        for segment in self._segments:
            if isinstance(segment, _Region) and not (broken_as_text and segment.broken):
                merged.append(segment)
                continue
            text = segment.text if isinstance(segment, _Text) else \
                self._text[segment.start:segment.mark]
            if merged and isinstance(merged[-1], str):
                merged[-1] += text
            else:
                merged.append(text)
        pieces = []
        for i, item in enumerate(merged):
            if not isinstance(item, str):
                continue
            if i > 0:
                item = item.lstrip(_WHITESPACE)
            if i + 1 < len(merged) or not final:
                item = item.rstrip(_WHITESPACE)
            if item:
                pieces.append(item)
        return "\n".join(pieces)

    def _delta(self, final: bool) -> StreamDelta:
        delta = StreamDelta(self._new_content(final))
        for call in self._calls[:self._max_calls]:
            sent = self._sent_arguments[call.index]
            if sent is None:
                delta.add(ToolCallDelta(call.index, call.call_id, call.name))
                sent = ""
            if len(call.arguments) > len(sent):
                delta.add(ToolCallDelta(call.index, arguments=call.arguments[len(sent):]))
            self._sent_arguments[call.index] = call.arguments
        return delta

    def _new_content(self, final: bool) -> str:
        """What _content(final) adds to what was sent, without building it all again:
        the text segments before the last one are settled (a region follows each), and
        their pieces are what was sent for them."""
        segments = self._segments
        growing = len(segments) - 1 if segments and isinstance(segments[-1], _Text) else len(segments)
        while self._num_settled < growing:
            segment = segments[self._num_settled]
            if isinstance(segment, _Text):
                piece = segment.text.strip(_WHITESPACE) if self._num_settled else \
                    segment.text.rstrip(_WHITESPACE)
                if piece:
                    self._settled += ("\n" if self._settled else "") + piece
            self._num_settled += 1
        tail = ""
        if growing < len(segments):
            tail = segments[-1].text
            if growing:
                tail = tail.lstrip(_WHITESPACE)
            if not final:
                tail = tail.rstrip(_WHITESPACE)
        separator = "\n" if self._settled and tail else ""
        settled_length = len(self._settled) + len(separator)
        if self._num_sent >= settled_length:
            new = tail[self._num_sent - settled_length:]
        else:
            new = (self._settled + separator + tail)[self._num_sent:]
        self._num_sent += len(new)
        return new


def _arguments_of(scanner: _JsonObject, text: str):
    for key in ("arguments", "parameters"):
        value = scanner.value(key, text)
        if value is not None:
            return value
    return None


def _skip_whitespace(text: str, at: int) -> int:
    n = len(text)
    while at < n and text[at] in _WHITESPACE:
        at += 1
    return at


def _opener_prefix(text: str, openers) -> int:
    """The length of the longest end of text that is the start of an opener."""
    best = 0
    for opener in openers:
        at = text.find(opener[0], max(0, len(text) - len(opener) + 1))
        while at >= 0:
            if opener.startswith(text[at:]):
                best = max(best, len(text) - at)
                break
            at = text.find(opener[0], at + 1)
    return best


def _string_or_none(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) and value else None


# ---- the formats -------------------------------------------------------------------------

class Llama3JsonParser(ToolCallParser):
    """{"name": ..., "parameters": {...}}, maybe after <|python_tag|>, several joined by ";"."""
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")

    def _scan_region(self, region, text, final):
        if region.stage == 0:
            if region.opener == "{":
                region.mark = region.start
            region.stage = 1
        if region.stage == 1:
            outcome = self._scan_object_call(region, text)
            if outcome != "done":
                return outcome
            region.stage = 2
        # a ";" after a call, and the whitespace around it, go with the call
        at = _skip_whitespace(text, region.mark)
        if at < len(text) and text[at] == ";":
            at = _skip_whitespace(text, at + 1)
        if at == len(text) and not final:
            return None
        region.mark = at
        return "done"


class HermesParser(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (the closing tag may be left
    out, or cut off, at the end of the reply)."""
    name = "hermes"
    openers = ("<tool_call>",)
    CLOSER = "</tool_call>"

    def _scan_region(self, region, text, final):
        if region.stage == 0:
            outcome = self._scan_object_call(region, text)
            if outcome != "done":
                return outcome
            region.stage = 1
        at = _skip_whitespace(text, region.mark)
        rest = text[at:at + len(self.CLOSER)]
        if rest == self.CLOSER:
            region.mark = at + len(self.CLOSER)
        elif self.CLOSER.startswith(rest):  # the text ends here (rest is short)
            if not final:
                return None  # what is there may be the start of the closing tag
            if rest:  # a reply cut off inside the closing tag: the start is the call's
                region.mark = len(text)
        return "done"


class MistralParser(ToolCallParser):
    """[TOOL_CALLS]name[ARGS]{...} (v11 and later, [CALL_ID]id before [ARGS] in v11; the
    text without [ARGS] is taken too), or [TOOL_CALLS] [{"name": ..., "arguments": {...},
    "id": ...}, ...] (tokenizers up to v7)."""
    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True
    LIST, NAME, CALL_ID, ARGUMENTS = 1, 2, 3, 4
    LIST_ITEM, LIST_NEXT = 5, 6

    def __init__(self, make_id=None, max_calls: int | None = None):
        super().__init__(make_id or mistral_call_id, max_calls)

    def _scan_region(self, region, text, final):
        if region.stage == 0:
            at = _skip_whitespace(text, region.mark)
            if at == len(text):
                return None
            is_list = text[at] == "[" and not text.startswith(("[ARGS]", "[CALL_ID]"), at)
            if is_list:
                region.mark, region.stage = at + 1, self.LIST_ITEM
            else:
                region.stage = self.NAME
        if region.stage == self.NAME:  # up to [CALL_ID], [ARGS] or "{"
            ends = [i for i in (text.find("[CALL_ID]", region.mark), text.find("[ARGS]", region.mark),
                                text.find("{", region.mark)) if i >= 0]
            end = min(ends) if ends else len(text) - _opener_prefix(text, ("[ARGS]", "[CALL_ID]"))
            name = text[region.mark:end].strip()
            if name and not _MISTRAL_NAME.fullmatch(name):
                return "fail"
            if not ends:
                return None
            if not name:
                return "fail"
            region.name, region.mark, region.stage = name, end, self.CALL_ID
        if region.stage == self.CALL_ID:
            if text.startswith("[CALL_ID]", region.mark):
                end = text.find("[ARGS]", region.mark)
                if end < 0:
                    return None
                region.call_id = text[region.mark + len("[CALL_ID]"):end].strip() or None
                region.mark = end
            if text.startswith("[ARGS]", region.mark):
                region.mark += len("[ARGS]")
            region.stage = self.ARGUMENTS
        if region.stage == self.ARGUMENTS:  # one JSON object
            if region.scanner is None:
                at = _skip_whitespace(text, region.mark)
                if at == len(text):
                    return None
                if text[at] != "{":
                    return "fail"
                region.scanner = _JsonObject(at)
                self._show(region)
            scanner = region.scanner
            scanner.scan(text)
            region.call.arguments = text[scanner.start:scanner.end if scanner.complete
                                         else scanner.pos]
            if scanner.failed:
                return "fail"
            if not scanner.complete:
                return None
            region.mark = scanner.end
            return "done"
        while True:  # the list form: objects, then "]"
            if region.stage == self.LIST_ITEM:
                outcome = self._scan_object_call(region, text)
                if outcome != "done":
                    return outcome
                region.stage = self.LIST_NEXT
            at = _skip_whitespace(text, region.mark)
            if at == len(text):
                return None
            if text[at] == "]":
                region.mark = at + 1
                return "done"
            if text[at] != ",":
                return "fail"
            region.mark, region.stage = at + 1, self.LIST_ITEM


_PARSERS = {"llama3_json": Llama3JsonParser, "hermes": HermesParser, "mistral": MistralParser}

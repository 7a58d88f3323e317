"""`cupy-llama chat`: a terminal chat over the chat template, with streaming replies.

`ChatSession` holds the conversation and the settings (no terminal code, easy to test);
`run_terminal` is the interactive loop; `run_once` answers one prompt (an argument or a
pipe). Ctrl-C during a reply stops it at the next token; the partial reply stays in the
history as the assistant's turn, so the conversation remains a valid alternation. When a
message would not fit the context, the oldest turns make room for it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CupyLlamaError, OptionError, RequestError, TokenizerError
from ..reasoning import ReasoningParser, ReasoningSplitter, thinking_markers
from ..util import counted, json_type

HELP = """\
/help                 this text
/exit, /bye           leave (Ctrl-D works too)
/clear                forget the conversation (the system prompt stays)
/retry                answer the last message again; the new reply replaces the old one
/system TEXT          set the system prompt (/system alone removes it)
/set NAME VALUE       change a setting: temperature, top_p, top_k, min_p, max_tokens, seed,
                      repetition_penalty, frequency_penalty, presence_penalty, min_tokens
/set                  show the settings
/stats                token counts and speed of this session
/save FILE            write the conversation to FILE as JSON (OpenAI-style messages)
/load FILE            continue a conversation written by /save (it replaces this one)
/tool CALL RESULT     with --tools: answer the model's tool call CALL (its id, or its
                      function's name when no other waiting call has it) with RESULT; once
                      every call of the reply has its result, the model answers
\"\"\"                   start and end multi-line input (Ctrl-D also ends it, and sends it);
                      it is a message even where it starts with a slash
Up, Down              earlier input, also from earlier sessions
Ctrl-C                stop the current reply; twice at the prompt exits
When a message would not fit the context, the oldest turns are dropped to make room
(never the system prompt)."""

# /set NAME -> how its value is read
SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
            "max_tokens": int, "seed": int, "repetition_penalty": float,
            "frequency_penalty": float, "presence_penalty": float, "min_tokens": int}
MULTILINE = '"""'
# A reply gets room for max_tokens, or for a quarter of the context when max_tokens is
# larger; older turns are dropped until the conversation leaves that much.
REPLY_SHARE_OF_CONTEXT = 4
HISTORY_LENGTH = 1000   # input lines kept in the history file
ROLES = ("system", "user", "assistant", "tool")
# Control characters other than newline and tab would move the cursor or recolor the
# terminal; model output shows them as U+FFFD.
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    return _CONTROL_CHARS.sub("\ufffd", text)


@dataclass(frozen=True)
class ChatTools:
    """--tools and the flags that go with it, checked (tool_choice.py)."""
    tools: list
    tool_choice: str | dict = "auto"
    parser: str | None = None  # None: the format the chat template shows
    parallel_tool_calls: bool = True  # False: a reply holds one call at most


def call_line(call: dict) -> str:
    """A tool call of the history as the chat shows it: one line, marked, with its id."""
    function = call["function"]
    arguments = function["arguments"]
    try:  # one line, whatever whitespace the model wrote
        arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        arguments = " ".join(arguments.split())
    return f"tool call {call['id']}: {function['name']} {arguments}"


@dataclass
class TurnStats:
    prompt_tokens: int
    completion_tokens: int
    seconds_to_first_token: float
    decode_seconds: float       # from the first token to the last
    finish_reason: str | None   # None: stopped with Ctrl-C
    context_limit: int | None = None  # set when the context limit cut the reply

    @property
    def tokens_per_second(self) -> float:
        # the clock starts after the first token (prefill is not decode speed)
        if self.completion_tokens < 2 or self.decode_seconds <= 0:
            return 0.0
        return (self.completion_tokens - 1) / self.decode_seconds

    def line(self) -> str:
        text = (f"{self.seconds_to_first_token * 1000:.0f} ms to first token, "
                f"{self.tokens_per_second:.1f} tok/s, {counted(self.completion_tokens, 'token')}")
        if self.context_limit is not None:
            text += (f" (stopped at the context limit of {self.context_limit} tokens; the "
                     "oldest turns make room for the next message)")
        elif self.finish_reason == "length":
            text += " (stopped at the token limit)"
        return text


def context_hint(llm) -> str:
    """What else the user can do when a prompt does not fit the context, named by the
    command line's flags: ' or ...' to follow 'shorten it', or '' when the context is
    already the model's own maximum."""
    engine_limit = llm.context_limit
    model_limit = llm.config.context_limit
    if engine_limit < llm.max_model_len:  # the KV cache is smaller than the context
        flags = "--num-kv-blocks" if llm.device == "cpu" else \
            "--num-kv-blocks or --gpu-memory-utilization"
        return f" or give the KV cache room for more than {engine_limit} tokens ({flags})"
    if engine_limit < model_limit:
        return f" or raise --max-model-len (the model takes up to {model_limit})"
    return ""


class ChatSession:
    def __init__(self, llm, params, system: str | None = None,
                 template_kwargs: dict | None = None, tools: ChatTools | None = None):
        self.llm = llm
        self.params = params
        self.system = system or None
        self.template_kwargs = template_kwargs  # more chat-template variables (--chat-template-kwargs)
        self.tools = tools
        self._shown_tools: tuple | None = None  # (ChatTools, the tools the template shows)
        self.interactive = False  # run_terminal's: its hints name the /commands
        # turns: a user message, then the assistant's reply; with tools, a reply with
        # tool_calls is followed by a tool message per call and the assistant's next reply
        self.history: list[dict] = []
        self.turns: list[TurnStats] = []
        # the conversation the last turn's counts are of (context_tokens): its length and
        # system prompt, None once it is replaced
        self._counted: tuple | None = None
        self.prompt_opens_thinking = False  # the last prompt ends inside <think> (ThinkingView)
        self.reply_token_ids: list[int] = []  # the reply's tokens so far, as reply() yields
        # <think> ... </think> in the model's vocabulary: where a prompt opens it
        self._markers = thinking_markers(llm.tokenizer)

    def messages(self, user_text: str) -> list[dict]:
        return self.conversation() + [{"role": "user", "content": user_text}]

    def conversation(self) -> list[dict]:
        """The system prompt (when set) and the turns, as OpenAI-style messages."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [dict(message) for message in self.history]

    def thinking_view(self) -> "ThinkingView":
        """A view of the reply about to stream (fed reply()'s deltas and reply_token_ids)."""
        return ThinkingView(self._markers, self.prompt_opens_thinking)

    @property
    def context_limit(self) -> int:
        return self.llm.context_limit

    @property
    def context_tokens(self) -> int:
        """The conversation's tokens (0 once cleared): the last reply's prompt and reply
        where the conversation is still the one they made, else (loaded, a new system
        prompt, tool results since) as the chat template renders it."""
        if not self.history:
            return 0
        if self.turns and self._counted == (len(self.history), self.system):
            return self.turns[-1].prompt_tokens + self.turns[-1].completion_tokens
        return len(self.llm.tokenizer.encode_chat(
            self.conversation(), add_generation_prompt=False, tools=self.template_tools,
            template_kwargs=self.template_kwargs))

    def clear(self) -> None:
        self.history = []
        self._counted = None

    def set(self, name: str, value: str) -> str:
        """Change one sampling setting; RequestError (one line) for a bad name or value."""
        if name not in SETTINGS:
            raise RequestError(f"unknown setting {name!r}; use one of {', '.join(SETTINGS)}")
        kind = SETTINGS[name]
        try:
            parsed = kind(value)
        except ValueError:
            kind_name = "an integer" if kind is int else "a number"
            raise RequestError(f"{name} must be {kind_name}, got {value!r}") from None
        limit = self.context_limit
        if name == "max_tokens" and parsed >= limit:  # as chat's --max-tokens is checked
            raise RequestError(f"max_tokens {parsed} leaves no room for a message: the context "
                               f"holds {limit} tokens, the conversation and the reply "
                               f"together; ask for fewer than {limit}")
        self.params = replace(self.params, **{name: parsed})  # validates
        return f"{name} = {parsed}"

    def settings(self) -> str:
        seed = "random" if self.params.seed is None else self.params.seed
        return ", ".join([f"{name} = {getattr(self.params, name)}" for name in SETTINGS
                          if name != "seed"] + [f"seed = {seed}"])

    # ---- fitting the context -----------------------------------------------------------

    @property
    def template_tools(self) -> list | None:
        """The tools the chat template is shown, "none" or not (None without tools:
        tool_choice.template_tools), worked out once for each ChatTools."""
        from ..tool_choice import template_tools
        tools = self.tools
        if tools is None:
            return None
        if self._shown_tools is None or self._shown_tools[0] is not tools:
            self._shown_tools = (tools, template_tools(
                self.llm.tokenizer, tools.tools, tools.tool_choice, None, self.template_kwargs))
        return self._shown_tools[1]

    def _messages(self, turns: list[dict], new: list[dict]) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + turns + new

    def _prompt(self, turns: list[dict], new: list[dict]) -> list[int]:
        def encode(messages):
            return self.llm.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                                  tools=self.template_tools,
                                                  template_kwargs=self.template_kwargs)
        try:
            return encode(self._messages(turns, new))
        except (RequestError, TokenizerError) as e:
            if not self.system:
                raise
            try:  # Gemma 2's template, for one, refuses a system message outright
                encode(turns + new)
            except CupyLlamaError:
                raise e from None  # it fails for a reason of its own
            fix = "clear it with /system" if self.interactive else "leave out --system"
            raise type(e)(f"{e}; this model's chat template takes no system prompt: "
                          f"{fix}") from None

    def fit(self, new: list[dict]) -> tuple[list[int], int]:
        """The prompt ids for the new messages (a user message, or the tool results that
        end a turn) after the conversation, and how many of the oldest messages must go
        so that it leaves room for a reply: whole turns (a user message up to the next
        one), never the turn the new messages end. RequestError when they do not fit even
        alone (with the system prompt)."""
        limit = self.context_limit
        room = max(1, min(self.params.max_tokens, limit // REPLY_SHARE_OF_CONTEXT))
        turns = [i for i, m in enumerate(self.history) if m["role"] == "user"]
        # where the turn being answered begins: tool results end one the history began
        current = turns.pop() if new[0]["role"] != "user" else len(self.history)

        def cut(num_turns: int) -> int:  # history[cut(k):] leaves the k oldest turns out
            return turns[num_turns] if num_turns < len(turns) else current

        prompt = self._prompt(self.history, new)
        dropped = 0
        while len(prompt) + room > limit and dropped < len(turns):
            dropped += 1
            prompt = self._prompt(self.history[cut(dropped):], new)
        if len(prompt) < limit:  # alone, it may leave less room than wished: still sent
            return prompt, cut(dropped) if dropped else 0
        system = "/system" if self.interactive else "--system"
        what = f"it or the system prompt ({system})" if self.system else "it"
        more = context_hint(self.llm)
        raise RequestError(
            f"this message does not fit: it makes a prompt of {len(prompt)} tokens"
            f"{' with the system prompt' if self.system else ''} and the context holds "
            f"{limit}, one of them for the reply, even with every earlier turn left out; "
            f"shorten {what}{',' if more and self.system else ''}{more}"
            + (". The conversation is unchanged (/clear empties it)" if self.interactive else ""))

    # ---- replies -----------------------------------------------------------------------

    def reply(self, user_text: str, should_stop=lambda: False, on_drop=None):
        """Yield the reply's text deltas (with tools, the lines of its calls last, from
        call_line); at each, self.reply_token_ids holds the reply's tokens so far.
        Afterwards the turn is in the history (also when stopped early) and its
        statistics in self.turns. Oldest turns that must go to make room are dropped
        first, and on_drop(number of turns) is told. Raises CupyLlamaError, with the
        history unchanged, when the request cannot run."""
        if self.waiting_calls():
            raise RequestError("the model's tool calls wait for their results: answer each "
                               "with /tool CALL RESULT first (or /clear)")
        yield from self._answer([{"role": "user", "content": user_text}], should_stop, on_drop)

    def waiting_calls(self) -> list[dict]:
        """The calls of the last reply that no tool message has answered yet."""
        answered, index = set(), len(self.history) - 1
        while index >= 0 and self.history[index]["role"] == "tool":
            answered.add(self.history[index].get("tool_call_id"))
            index -= 1
        if index < 0 or not self.history[index].get("tool_calls"):
            return []
        return [c for c in self.history[index]["tool_calls"] if c["id"] not in answered]

    def tool_result(self, call: str, result: str, should_stop=lambda: False, on_drop=None):
        """Answer the waiting call whose id (or function name) is `call` with a tool
        message; with the last one answered, yield the model's reply as reply() does.
        RequestError, with the history unchanged, when no waiting call is meant."""
        waiting = self.waiting_calls()
        if not waiting:
            raise RequestError("no tool call is waiting for a result")
        chosen = [c for c in waiting if c["id"] == call] or \
            [c for c in waiting if c["function"]["name"] == call]
        listed = ", ".join(f"{c['id']} ({c['function']['name']})" for c in waiting)
        if not chosen:
            raise RequestError(f"no waiting tool call has the id or name {call!r}; waiting: "
                               f"{listed}")
        if len(chosen) > 1:
            raise RequestError(f"several waiting calls are to {call!r}; name one by its id: "
                               f"{listed}")
        message = {"role": "tool", "tool_call_id": chosen[0]["id"], "content": result}
        if len(waiting) > 1:  # the model answers once every call has its result
            self.history.append(message)
            return
        new = []
        while self.history[-1]["role"] == "tool":  # the turn's results go in together
            new.insert(0, self.history.pop())
        num_turns = len(self.turns)
        try:
            yield from self._answer(new + [message], should_stop, on_drop)
        except CupyLlamaError:
            if len(self.turns) == num_turns:  # no reply: the results recorded stay
                self.history += new
            raise

    def _answer(self, new: list[dict], should_stop, on_drop):
        prompt, dropped = self.fit(new)
        params = self.params
        if self._markers is not None and self._markers.special:
            # the reply's text keeps the thinking's markers, as serve's with a reasoning
            # parser does: ThinkingView finds the end of the thinking in it
            params = replace(params, skip_special_tokens=False)
        started = time.perf_counter()
        # the request is added (and checked) before any turn is dropped
        if self.tools is None:
            stream = self.llm.generate(prompt, params, stream=True)
        else:  # parsed as it comes: calls never show as text ("none": not parsed)
            tools = self.tools
            stream = self.llm.chat(
                self._messages(self.history[dropped:], new), params, stream=True,
                chat_template_kwargs=self.template_kwargs, tools=tools.tools,
                tool_choice=tools.tool_choice, tool_call_parser=tools.parser,
                parallel_tool_calls=tools.parallel_tool_calls)
        markers = self._markers  # the template opened the thinking (DeepSeek-R1's do)
        self.prompt_opens_thinking = markers is not None and markers.start_token is not None \
            and markers.last_marker(prompt) == markers.start_token
        if dropped:
            num_turns = sum(m["role"] == "user" for m in self.history[:dropped])
            del self.history[:dropped]
            if on_drop is not None:
                on_drop(num_turns)
        first_token_at = last_token_at = None
        text, output = "", None
        self.reply_token_ids = []
        try:
            for latest in stream:
                if should_stop():  # Ctrl-C came while this step ran: its token is not shown
                    break
                output = latest
                now = time.perf_counter()
                if first_token_at is None and output.token_ids:
                    first_token_at = now
                last_token_at = now
                if output.delta:
                    text += output.delta
                    self.reply_token_ids = output.token_ids
                    yield output.delta
        finally:
            stream.close()  # aborts the request if it is still running
        finished = output is not None and output.finished
        if finished and not output.tool_calls and output.content \
                and output.content.startswith(text) and output.content != text:
            # a reply cut off inside a call streamed that call's pieces as tool-call deltas;
            # with no call to show, the text it got to is the reply (the parse's content)
            yield output.content[len(text):]
            text = output.content
        answer = {"role": "assistant", "content": text}
        if finished and output.tool_calls:
            answer = {"role": "assistant", "content": output.content,
                      "tool_calls": [call.to_openai() for call in output.tool_calls]}
        self.history += new + [answer]
        first_token_at = first_token_at or time.perf_counter()
        completion = len(output.token_ids) if output else 0
        cut_by_context = (finished and output.finish_reason == "length"
                          and completion < params.max_tokens
                          and len(prompt) + completion >= self.context_limit)
        self.turns.append(TurnStats(
            prompt_tokens=len(prompt), completion_tokens=completion,
            seconds_to_first_token=first_token_at - started,
            decode_seconds=(last_token_at or first_token_at) - first_token_at,
            finish_reason=output.finish_reason if finished else None,
            context_limit=self.context_limit if cut_by_context else None))
        self._counted = (len(self.history), self.system)
        if answer.get("tool_calls"):  # shown as calls, never as the text the model wrote
            yield ("\n" if text else "") + "\n".join(map(call_line, answer["tool_calls"]))

    def retry(self, should_stop=lambda: False, on_drop=None):
        """Yield a new reply to the last message; it replaces the last reply. RequestError
        when there is none; the history is unchanged when the reply cannot start."""
        if not self.history:
            raise RequestError("nothing to retry yet: send a message first")
        if self.history[-1]["role"] != "assistant":
            raise RequestError("nothing to retry: the model's tool calls wait for their "
                               "results (/tool CALL RESULT)")
        start = len(self.history) - 1  # the messages the last reply answered begin here
        while start > 0 and self.history[start - 1]["role"] != "assistant":
            start -= 1
        last = self.history[start:]
        del self.history[start:]
        num_turns = len(self.turns)
        try:
            yield from self._answer(last[:-1], should_stop, on_drop)
        except CupyLlamaError:
            if len(self.turns) == num_turns:  # no new reply: the old one stays
                self.history += last
            raise

    def stats(self) -> str:
        if not self.turns:
            return f"no replies yet; settings: {self.settings()}"
        completion = sum(t.completion_tokens for t in self.turns)
        decode = sum(t.decode_seconds for t in self.turns)
        decoded = sum(max(0, t.completion_tokens - 1) for t in self.turns)
        rate = decoded / decode if decode > 0 else 0.0
        ttft = sum(t.seconds_to_first_token for t in self.turns) / len(self.turns)
        engine = self.llm.stats()
        replies = counted(len(self.turns), "reply", "replies")
        return (f"{replies}, {counted(completion, 'token')} generated, {rate:.1f} tok/s "
                f"on average, {ttft * 1000:.0f} ms to first token on average\n"
                f"context: {self.context_tokens} of {self.context_limit} tokens in use\n"
                f"prefix cache: {engine.prefix_cache_hits} of {engine.prefix_cache_queries} "
                f"prompt tokens came from earlier turns\n"
                f"settings: {self.settings()}")

    # ---- files -------------------------------------------------------------------------

    def save(self, path: str) -> str:
        """Write the conversation as a JSON list of messages; RequestError (one line) when
        the file cannot be written."""
        messages = self.conversation()
        try:
            Path(path).expanduser().write_text(
                json.dumps(messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise RequestError(f"cannot write {path!r} ({e.strerror or e}); pick another "
                               "file") from None
        return f"saved {len(messages)} messages to {path}"

    def load(self, path: str) -> str:
        """Replace the conversation (and the system prompt) with the one in the file."""
        try:
            data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
        except OSError as e:
            raise RequestError(f"cannot read {path!r} ({e.strerror or e})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"{path} is not a JSON file ({e}); /load reads what /save "
                               "writes") from None
        system, history = parse_conversation(data, path)
        self.system, self.history, self._counted = system, history, None
        count = len(self.conversation())  # as /save counts them: the system prompt too
        prompt = "a system prompt among them" if system else "no system prompt"
        return f"loaded {counted(count, 'message')} from {path} ({prompt})"


def parse_conversation(data, name: str) -> tuple[str | None, list[dict]]:
    """(system prompt, turns) of a conversation as /save writes it: a JSON list of
    {"role", "content"} messages, a system message only first, then user and assistant
    messages taking turns, the last one the assistant's; an assistant message may carry
    OpenAI "tool_calls" (its content then may be null), answered by a "tool" message
    ("tool_call_id") each before the assistant goes on. RequestError names what is wrong."""
    from ..tokenizer import check_unicode, text_of_parts

    if not isinstance(data, list):
        raise RequestError(f"{name} must hold a JSON list of messages, got "
                           f"{json_type(data)}")
    messages = []
    for number, message in enumerate(data, start=1):
        where = f"{name}: message {number}"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'")
        if isinstance(message.get("content"), list):  # OpenAI's text parts: one text
            message = {**message, "content": text_of_parts(
                message["content"], f"{where}'s content", message.get("role"))}
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        keys = ("role",) if calls is not None and message.get("content") is None else \
            ("role", "content")
        keys += ("tool_call_id",) if message.get("role") == "tool" else ()
        for key in keys:
            if not isinstance(message.get(key), str):
                problem = "has no" if key not in message else "needs a string as its"
                raise RequestError(f"{where} {problem} {key!r}")
            check_unicode(message[key], f"{where}'s {key}")
        role = message["role"]
        if role not in ROLES:
            raise RequestError(f"{where} has role {role!r}; a conversation holds "
                               f"{', '.join(ROLES)} messages")
        kept = {key: message[key] for key in keys}
        kept.setdefault("content", None)
        if calls is not None:
            kept["tool_calls"] = _checked_calls(calls, where)
        messages.append(kept)
    system = None
    if messages and messages[0]["role"] == "system":
        system = messages.pop(0)["content"] or None
    offset = len(data) - len(messages)
    waiting: list[str] = []  # ids of the calls not answered yet
    wanted = "user"
    for index, message in enumerate(messages):
        role = message["role"]
        if role != wanted and not (wanted == "tool" and not waiting):
            raise RequestError(f"{name}: message {index + offset + 1} is {_a(role)} "
                               f"message where {_a(wanted)} message belongs; a system message "
                               "may come first, then user and assistant messages take turns "
                               "(with tool messages after an assistant's tool_calls)")
        if role == "assistant" and message.get("tool_calls"):
            waiting, wanted = [c["id"] for c in message["tool_calls"]], "tool"
        elif role == "tool":
            if message["tool_call_id"] in waiting:
                waiting.remove(message["tool_call_id"])
            wanted = "tool" if waiting else "assistant"
        else:
            wanted = "assistant" if role == "user" else "user"
    if wanted == "assistant":
        last = "the user's" if messages[-1]["role"] == "user" else "a tool result"
        raise RequestError(f"{name}: the last message is {last}, with no reply; end the "
                           "conversation with an assistant message")
    return system, messages


def _checked_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as the chat keeps them: id, name, arguments."""
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"{where}'s tool_calls must be a list of calls")
    kept = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(call.get("id"), str)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise RequestError(f"{where}'s tool_calls must each be {{\"id\", \"type\": "
                               f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        kept.append({"id": call["id"], "type": "function", "function": {
            "name": function["name"], "arguments": function["arguments"]}})
    return kept


def _a(role: str) -> str:
    return ("an " if role == "assistant" else "a ") + role


# ---- a reply's thinking -------------------------------------------------------------------


class ThinkingView:
    """A reply's text as the chat shows it: ("thinking", text) for what a reasoning model
    writes between its <think> and </think> tokens (Qwen3, DeepSeek-R1), ("answer", text)
    for the rest, split as serve's --reasoning-parser splits it (reasoning.py: the same
    text in ordinary tokens is no marker). A reply thinks when its first token is <think>,
    or when its prompt opened it. Only the display: the history keeps the text as written
    (these models' templates drop the thinking of earlier turns themselves)."""

    def __init__(self, markers: ReasoningParser | None, prompt_opened: bool):
        """markers: the vocabulary's <think> and </think> (None where it has no </think>
        token: the reply is all answer)."""
        self._markers = markers
        self._splitter = ReasoningSplitter(markers, True) if prompt_opened else None
        self._first_decides = markers is not None and not prompt_opened  # <think> first?
        self._num_tokens = 0
        self._answered = False

    def feed(self, text: str, token_ids) -> list[tuple[str, str]]:
        """text: the reply's new text; token_ids: all its tokens so far."""
        new = token_ids[self._num_tokens:]
        self._num_tokens = len(token_ids)
        if self._first_decides and new:
            self._first_decides = False
            if new[0] == self._markers.start_token:
                self._splitter = ReasoningSplitter(self._markers, True)
        if self._splitter is None:
            return self._pieces("", text)
        return self._pieces(*self._splitter.feed(text, new))

    def finish(self) -> list[tuple[str, str]]:
        return self._pieces(*self._splitter.finish()) if self._splitter is not None else []

    def _pieces(self, thinking: str, answer: str) -> list[tuple[str, str]]:
        if self._splitter is not None and not self._answered:
            answer = answer.lstrip("\n")  # the blank line after </think>
        self._answered = self._answered or bool(answer)
        return [piece for piece in (("thinking", thinking), ("answer", answer)) if piece[1]]


# ---- one prompt ---------------------------------------------------------------------------

def piped_prompt(text: str) -> str:
    """The message piped into `chat`, without the newline `echo` adds; OptionError when
    there is none (a usage error, as an empty PROMPT is)."""
    prompt = text.strip()
    if not prompt:
        raise OptionError("stdin is empty; pipe a prompt in, e.g. echo 'Hello' | cupy-llama "
                          "chat, or give it as PROMPT: cupy-llama chat 'Hello'")
    return prompt


def run_once(session: ChatSession, prompt: str, out=None, err=None) -> int:
    """Answer one prompt: the answer alone to stdout, the thinking (dimmed in a terminal),
    notes and statistics to stderr."""
    out = out or sys.stdout
    err = err or sys.stderr
    shown = printable if _isatty(out) else (lambda text: text)
    write = _PieceWriter(out, err, shown)

    def dropped(count: int) -> None:
        err.write(_dropped_note(session, count) + "\n")

    view = None
    for delta in session.reply(prompt, on_drop=dropped):
        view = view or session.thinking_view()
        write(view.feed(delta, session.reply_token_ids))
    if view is not None:
        write(view.finish())
    if write.thought and not write.thought.endswith("\n"):
        err.write("\n")  # the statistics line goes on a line of its own
    out.write("\n")
    out.flush()
    err.write(session.turns[-1].line() + "\n")
    return 0


class _PieceWriter:
    """A one-prompt reply's pieces: the answer to out, the thinking to err (stdout holds
    the answer alone), dimmed where err is a terminal that shows it and colour is on. Where both are the
    terminal, the answer starts on a line of its own after the thinking (err gets the line
    break). thought: the last thinking written whose line is still open ("" for none)."""

    def __init__(self, out, err, shown):
        self.out, self.err, self.shown = out, err, shown
        self.dim, self.normal = ("\x1b[2m", "\x1b[0m") if (
            _isatty(err) and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb") else ("", "")
        self.shared_screen = _isatty(out) and _isatty(err)
        self.thought = ""

    def __call__(self, pieces) -> None:
        for kind, text in pieces:
            if kind == "thinking":
                self.err.write(f"{self.dim}{self.shown(text)}{self.normal}")
                self.err.flush()
                self.thought = text
                continue
            if self.thought and self.shared_screen:
                if not self.thought.endswith("\n"):
                    self.err.write("\n")
                    self.err.flush()
                self.thought = ""
            self.out.write(self.shown(text))
            self.out.flush()


def _waiting_note(waiting: list[dict]) -> str:
    calls = ", ".join(f"{c['id']} ({c['function']['name']})" for c in waiting)
    return f"(waiting for tool results: /tool CALL RESULT for {calls})"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _dropped_note(session: ChatSession, count: int) -> str:
    turns = "the oldest turn" if count == 1 else f"the {count} oldest turns"
    return (f"(dropped {turns} to fit the context of {session.context_limit} tokens; "
            "the system prompt stays)")


# ---- the interactive terminal -------------------------------------------------------------

class _Interrupts:
    """Owns SIGINT while the terminal chat runs, whatever disposition the process inherited
    (a shell starts background jobs with SIGINT ignored, and Python then leaves it
    ignored; the chat would take Ctrl-C during a reply but not at the prompt). At the
    prompt Ctrl-C raises KeyboardInterrupt, as Python's own handler does. During a reply it
    only sets a flag, so the reply ends between two engine steps and the engine's state
    stays whole."""

    def __init__(self):
        self.replying = False
        self.is_set = False

    def __call__(self, signum, frame):
        if not self.replying:
            raise KeyboardInterrupt
        self.is_set = True

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)

    @contextmanager
    def during_reply(self):
        self.is_set, self.replying = False, True
        try:
            yield
        finally:
            self.replying = False


@contextmanager
def line_editing(history_path: Path | None, colour: bool):
    """readline for input() (line editing, and input history kept in history_path across
    sessions, at most HISTORY_LENGTH lines); yields the two prompts, colored when colour
    is on (readline is told which characters are invisible). A history file that cannot
    be read or written never stops the chat."""
    try:
        import readline
    except ImportError:
        yield ">>> ", "... "
        return
    readline.set_history_length(HISTORY_LENGTH)
    if history_path is not None:
        try:
            readline.read_history_file(str(history_path))
        except (OSError, UnicodeError, ValueError):
            pass  # none yet, or unreadable: start with an empty history
    green, reset = ("\001\x1b[1;32m\002", "\001\x1b[0m\002") if colour else ("", "")
    try:
        yield f"{green}>>> {reset}", f"{green}... {reset}"
    finally:
        if history_path is not None:
            try:
                history_path.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(str(history_path))
            except (OSError, UnicodeError, ValueError):
                pass


def read_message(read_line, first_prompt: str, more_prompt: str) -> tuple[str, bool]:
    """One message and whether it came as a block: a line, or a multi-line block opened
    and closed by triple quotes (Ctrl-D inside the block ends it too: what was typed is the
    message). A block is always a message, never a /command, so pasted text that starts
    with a path can be sent."""
    line = read_line(first_prompt)
    if not line.lstrip().startswith(MULTILINE):
        return line, False
    body = line.lstrip()[len(MULTILINE):]
    if body.rstrip().endswith(MULTILINE):   # """text""" on one line
        return body.rstrip()[:-len(MULTILINE)], True
    lines = [body] if body else []
    while True:
        try:
            line = read_line(more_prompt)
        except EOFError:
            return "\n".join(lines).strip("\n"), True
        if line.rstrip().endswith(MULTILINE):
            lines.append(line.rstrip()[:-len(MULTILINE)])
            return "\n".join(lines).strip("\n"), True
        lines.append(line)


def use_colour(console) -> bool:
    """Colour (and the dim and bold styles) only on a terminal that shows it, never with
    NO_COLOR set (https://no-color.org)."""
    return not os.environ.get("NO_COLOR") and console.color_system is not None


def run_terminal(session: ChatSession, console, err_console, read_line=input,
                 history_path: Path | None = None) -> int:
    """The interactive loop; returns the exit code (0 for /exit or Ctrl-D, 130 for Ctrl-C
    twice at the prompt)."""
    session.interactive = True

    def read(prompt: str) -> str:
        try:
            return read_line(prompt)
        except EOFError:
            console.print()  # Ctrl-D leaves the cursor after the prompt
            raise

    with _Interrupts() as interrupts, \
            line_editing(history_path, use_colour(console)) as (first_prompt, more_prompt):
        err_console.print("[dim]Type a message, /help for commands, Ctrl-D to leave.[/dim]",
                          highlight=False)
        interrupted_once = False
        while True:
            try:
                text, block = read_message(read, first_prompt, more_prompt)
                interrupted_once = False
                if not text.strip():
                    continue
                if text.startswith("/") and not block:
                    if _command(session, text.strip(), console, err_console,
                                interrupts) == "exit":
                        return 0
                    continue
                _show_reply(session, console, err_console, interrupts,
                            lambda stop, on_drop: session.reply(text, stop, on_drop))
            except EOFError:
                return 0
            except KeyboardInterrupt:
                if interrupted_once:
                    console.print()
                    return 130
                interrupted_once = True
                err_console.print("\n[dim](press Ctrl-C again or Ctrl-D to leave)[/dim]",
                                  highlight=False)


def _show_reply(session: ChatSession, console, err_console, interrupts, deltas) -> None:
    """Stream one reply: deltas(should_stop, on_drop) yields its text."""
    from rich.markup import escape

    out = console.file

    def dropped(count: int) -> None:
        err_console.print(f"[dim]{escape(_dropped_note(session, count))}[/dim]",
                          highlight=False)

    dim, normal = ("\x1b[2m", "\x1b[0m") if use_colour(console) else ("", "")
    view = None

    last = [None, ""]  # the kind and text of the last piece shown

    def show(pieces) -> None:
        for kind, text in pieces:
            if kind == "thinking":
                out.write(f"{dim}{printable(text)}{normal}")
            else:
                if last[0] == "thinking" and not last[1].endswith("\n"):
                    out.write("\n")  # the answer on a line of its own
                out.write(printable(text))
            last[:] = kind, text
        out.flush()

    with interrupts.during_reply():
        try:
            for delta in deltas(lambda: interrupts.is_set, dropped):
                view = view or session.thinking_view()
                show(view.feed(delta, session.reply_token_ids))
            if view is not None:
                show(view.finish())
        except CupyLlamaError as e:
            err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
            return
    waiting = session.waiting_calls()
    if waiting and session.history[-1]["role"] == "tool":  # a result recorded, no reply yet
        err_console.print(f"[dim]{escape(_waiting_note(waiting))}[/dim]", highlight=False)
        return
    out.write("\n")
    out.flush()
    turn = session.turns[-1]
    if turn.finish_reason is None:
        err_console.print("[yellow](reply stopped; the part shown stays in the conversation)"
                          "[/yellow]", highlight=False)
    err_console.print(f"[dim]{escape(turn.line())}[/dim]", highlight=False)
    if waiting:
        err_console.print(f"[dim]{escape(_waiting_note(waiting))}[/dim]", highlight=False)


def _command(session: ChatSession, line: str, console, err_console, interrupts) -> str | None:
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    say = lambda message: err_console.print(message, markup=False, highlight=False,  # noqa: E731
                                            soft_wrap=True)

    def attempt(action) -> None:
        try:
            say(action())
        except RequestError as e:
            say(f"error: {e}")

    if name in ("/exit", "/bye", "/quit"):
        return "exit"
    if name == "/help":
        say(HELP)
    elif name == "/clear":
        session.clear()
        say("conversation cleared")
    elif name == "/retry":
        if session.history and session.params.is_greedy:
            say("(greedy decoding, temperature 0, gives the same reply again; "
                "/set temperature 0.7 samples a different one)")
        elif session.history and session.params.seed is not None:
            say(f"(the fixed seed {session.params.seed} gives the same reply again; "
                "/set seed -1 samples a different one)")
        _show_reply(session, console, err_console, interrupts, session.retry)
    elif name == "/system":
        had = session.system is not None
        session.system = argument or None
        say("system prompt set" if argument else "system prompt removed" if had else
            "there is no system prompt to remove; /system TEXT sets one")
    elif name == "/set":
        parts = argument.split()
        if not parts:
            say(session.settings())
        elif len(parts) != 2:
            say("usage: /set NAME VALUE, e.g. /set temperature 0.7")
        else:
            attempt(lambda: session.set(parts[0], parts[1]))
    elif name == "/stats":
        say(session.stats())
    elif name == "/tool":
        call, _, result = argument.partition(" ")
        if not call or not result.strip():
            say("usage: /tool CALL RESULT, e.g. /tool get_weather 22C and sunny (CALL: the "
                "call's id, or its function's name)")
        else:
            _show_reply(session, console, err_console, interrupts,
                        lambda stop, on_drop: session.tool_result(call, result.strip(), stop,
                                                                  on_drop))
    elif name in ("/save", "/load"):
        if not argument:
            say(f"usage: {name} FILE, e.g. {name} chat.json")
        else:
            attempt(lambda: (session.save if name == "/save" else session.load)(argument))
    else:
        say(f"unknown command {name}; type /help for the list")
    return None

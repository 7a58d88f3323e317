"""`cupy-llama chat`: the session logic in-process, the pipe mode, and the interactive UI
driven through a pseudo-terminal."""
from dataclasses import replace
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.cli.chat_ui import ChatSession, parse_conversation, printable, read_message
from cupy_llama.errors import RequestError, TokenizerError
from cupy_llama.bench.random_model import make_random_model

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a long context, so an endless greedy reply runs long enough to be interrupted
    return make_random_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0,
                             std=0.15, max_position_embeddings=16384)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", log=None)


def reply_text(llm, messages, params=GREEDY):
    return llm.chat(messages, params).text


def user(text):
    return {"role": "user", "content": text}


# ---- the session, no terminal --------------------------------------------------------------

def test_history_follows_the_chat_template(llm):
    session = ChatSession(llm, GREEDY, system="Be brief.")
    first = "".join(session.reply("hello"))
    assert first == reply_text(llm, [{"role": "system", "content": "Be brief."}, user("hello")])
    second = "".join(session.reply("and again"))
    assert second == reply_text(llm, [{"role": "system", "content": "Be brief."}, user("hello"),
                                      {"role": "assistant", "content": first}, user("and again")])
    assert [m["role"] for m in session.history] == ["user", "assistant"] * 2
    assert session.turns[-1].completion_tokens == 12 and session.turns[-1].finish_reason == "length"
    session.clear()
    assert "".join(session.reply("hello")) == first


def test_stopping_a_reply_keeps_the_part_shown(llm):
    """should_stop is asked as each token comes: Ctrl-C while the fifth is computed (the
    fifth ask says stop) shows four tokens, not one more after the stop."""
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    count = 0

    def stop_at_the_fifth():
        nonlocal count
        count += 1
        return count >= 5

    shown = "".join(session.reply("hello", should_stop=stop_at_the_fifth))
    assert session.history[-1] == {"role": "assistant", "content": shown}
    assert session.turns[-1].finish_reason is None and session.turns[-1].completion_tokens == 4
    four = llm.generate(session.llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}]),
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert four.text.startswith(shown)  # (a character still partial is held back)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    "".join(session.reply("next"))  # the conversation goes on
    assert len(session.history) == 4


def test_a_message_that_does_not_fit_alone_is_refused_and_the_history_stays(model_dir):
    small = LLM(model_dir, device="cpu", log=None, max_model_len=128)
    session = ChatSession(small, GREEDY)
    "".join(session.reply("hi"))
    before = list(session.history)
    with pytest.raises(RequestError) as refused:
        "".join(session.reply("x" * 200))
    message = str(refused.value)
    assert "does not fit" in message and "the context holds 128" in message
    assert "/clear" not in message and "\n" not in message  # one-shot: no /commands
    # 128 is below the model's 16384: the flag that raises it is named, with the limit
    assert "--max-model-len (the model takes up to 16384)" in message
    assert session.history == before and len(session.turns) == 1
    session.interactive = True  # at the terminal: the history stays, /clear empties it
    with pytest.raises(RequestError, match=r"The conversation is unchanged \(/clear"):
        "".join(session.reply("x" * 200))


def test_at_the_model_s_own_limit_the_refusal_does_not_offer_a_larger_context(tmp_path):
    model = make_random_model(tmp_path / "m", "tiny", seed=0, std=0.15,
                              max_position_embeddings=128)
    session = ChatSession(LLM(model, device="cpu", log=None), GREEDY, system="Be brief.")
    with pytest.raises(RequestError) as refused:
        "".join(session.reply("x" * 200))
    message = str(refused.value)
    assert "max-model-len" not in message and "max_model_len" not in message
    assert "with the system prompt" in message and "(--system)" in message
    session.interactive = True
    with pytest.raises(RequestError, match=r"\(/system\)"):
        "".join(session.reply("x" * 200))


def small_context_session(model_dir, limit, max_tokens, system=None):
    small = LLM(model_dir, device="cpu", log=None, max_model_len=limit)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return small, ChatSession(small, params, system=system)


def test_the_oldest_turns_make_room_and_the_system_prompt_stays(model_dir):
    limit, max_tokens = 256, 24
    small, session = small_context_session(model_dir, limit, max_tokens, system="Be brief.")
    system = [{"role": "system", "content": "Be brief."}]
    everything, notes = [], []
    for number in range(1, 7):
        text = f"message number {number}"
        kept_before = list(session.history)
        reply = "".join(session.reply(text, on_drop=notes.append))
        everything += [user(text), {"role": "assistant", "content": reply}]
        kept = session.history[:-2]
        # what is kept is the newest part of the conversation, and it was answered as such
        assert kept == kept_before[len(kept_before) - len(kept):]
        assert reply == reply_text(small, system + kept + [user(text)],
                                   SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True))
        prompt = small.tokenizer.encode_chat(system + kept + [user(text)])
        assert session.turns[-1].prompt_tokens == len(prompt)
        # room for the whole reply was left, and no more turns than needed were dropped
        assert len(prompt) + max_tokens <= limit
        if len(kept) < len(kept_before):
            one_more = kept_before[len(kept_before) - len(kept) - 2:]
            longer = small.tokenizer.encode_chat(system + one_more + [user(text)])
            assert len(longer) + max_tokens > limit
        assert session.conversation()[0] == system[0]
    assert notes and sum(notes) == (len(everything) - len(session.history)) // 2
    assert session.history == everything[len(everything) - len(session.history):]


def test_a_reply_cut_by_the_context_limit_says_so(model_dir):
    _, session = small_context_session(model_dir, limit=160, max_tokens=1000)
    "".join(session.reply("tell me a long story"))
    turn = session.turns[-1]
    assert turn.finish_reason == "length" and turn.completion_tokens < 1000
    assert turn.prompt_tokens + turn.completion_tokens == 160
    assert "stopped at the context limit of 160 tokens" in turn.line()
    assert "token limit" not in turn.line()
    # the next message makes room by dropping that turn, and is answered
    notes = []
    "".join(session.reply("and then?", on_drop=notes.append))
    assert notes == [1] and len(session.history) == 2
    _, capped = small_context_session(model_dir, limit=160, max_tokens=5)
    "".join(capped.reply("tell me a long story"))
    assert capped.turns[-1].line().endswith("(stopped at the token limit)")


def test_retry_answers_the_last_message_again(llm):
    session = ChatSession(llm, GREEDY)
    with pytest.raises(RequestError, match="nothing to retry"):
        "".join(session.retry())
    first = "".join(session.reply("hello"))
    second = "".join(session.reply("more"))
    again = "".join(session.retry())
    assert again == second  # greedy: the same reply, in place of the old one
    assert session.history == [user("hello"), {"role": "assistant", "content": first},
                               user("more"), {"role": "assistant", "content": again}]
    assert len(session.turns) == 3


def test_save_and_load_a_conversation(llm, tmp_path):
    session = ChatSession(llm, GREEDY, system="Be brief.")
    first = "".join(session.reply("hello"))
    path = tmp_path / "chat.json"
    assert session.save(str(path)) == f"saved 3 messages to {path}"
    assert json.loads(path.read_text()) == [
        {"role": "system", "content": "Be brief."}, user("hello"),
        {"role": "assistant", "content": first}]
    other = ChatSession(llm, GREEDY)
    # one unit: /load counts what /save counted
    assert other.load(str(path)) == f"loaded 3 messages from {path} (a system prompt among them)"
    assert other.system == "Be brief." and other.history == session.history
    assert "".join(other.reply("next")) == "".join(session.reply("next"))
    # without a system message, loading removes the system prompt
    path.write_text(json.dumps([user("a"), {"role": "assistant", "content": "b"}]))
    assert "no system prompt" in other.load(str(path)) and other.system is None
    # OpenAI's text parts, as LLM.chat and the server take them: one text
    path.write_text(json.dumps([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]},
                                {"role": "assistant", "content": [
                                    {"type": "refusal", "refusal": "c"}]}]))
    other.load(str(path))
    assert [m["content"] for m in other.history] == ["a\nb", "c"]
    with pytest.raises(RequestError, match="cannot write"):
        session.save(str(tmp_path / "no-folder" / "chat.json"))


def test_a_template_that_refuses_a_system_prompt_says_how_to_go_on(model_dir, tmp_path):
    """Gemma 2's template raises on a system message: the error says to leave it out."""
    import shutil
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    llm = LLM(copy, device="cpu", log=None)
    session = ChatSession(llm, GREEDY, system="Be brief.")
    with pytest.raises(TokenizerError, match="System role not supported; this model's chat "
                                           "template takes no system prompt: leave out "
                                           "--system"):
        "".join(session.reply("hi"))
    session.interactive = True
    with pytest.raises(TokenizerError, match="clear it with /system"):
        "".join(session.reply("hi"))
    session.system = None
    assert "".join(session.reply("hi")) == session.history[-1]["content"]
    llm.close()
    # a template that fails whatever the system prompt gets no such hint, though its
    # message names the system role
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'twice' %}{{ raise_exception("
        "'After the optional system message, roles must alternate') }}{% endif %}"
        "{{ m.content }}{% endfor %}")
    llm = LLM(copy, device="cpu", log=None)
    session = ChatSession(llm, GREEDY, system="Be brief.")
    with pytest.raises(TokenizerError) as caught:
        "".join(session.reply("twice"))
    assert str(caught.value).endswith("roles must alternate")
    llm.close()


def test_context_in_use_is_the_conversation_s(llm, tmp_path):
    """/stats' context is the conversation's as it is now: a loaded one's as its template
    renders it, not the replaced one's last reply; the last reply's prompt and reply while
    the conversation is the one they made."""
    session = ChatSession(llm, GREEDY)
    "".join(session.reply("a long first message " * 8))
    turn = session.turns[-1]
    assert session.context_tokens == turn.prompt_tokens + turn.completion_tokens
    path = tmp_path / "short.json"
    path.write_text(json.dumps([user("hi"), {"role": "assistant", "content": "ok"}]))
    session.load(str(path))
    rendered = llm.tokenizer.encode_chat(session.conversation(), add_generation_prompt=False)
    assert session.context_tokens == len(rendered) < turn.prompt_tokens
    session.system = "Be brief."
    assert session.context_tokens == len(llm.tokenizer.encode_chat(
        session.conversation(), add_generation_prompt=False))
    session.clear()
    assert session.context_tokens == 0


@pytest.mark.parametrize("data, fragment", [
    ({"role": "user", "content": "hi"}, "must hold a JSON list of messages, got an object"),
    (["hi"], "message 1 must be an object"),
    ([{"content": "hi"}], "message 1 has no 'role'"),
    ([{"role": "user", "content": ["a"]}],
     "message 1's content[0] must be {'type': 'text', 'text': ...} (got 'str')"),
    ([{"role": "user", "content": 5}], "message 1 needs a string as its 'content'"),
    ([{"role": "robot", "content": "x"}], "message 1 has role 'robot'"),
    ([{"role": "tool", "tool_call_id": "a", "content": "x"}],
     "message 1 is a tool message where a user message belongs"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "x"}],
     "the last message is a tool result, with no reply"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": "f()"}],
     "message 2's tool_calls must be a list of calls"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
     "message 2 is a system message where an assistant message belongs"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 2 is a user message where an assistant message belongs"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
     "message 2 is an assistant message where a user message belongs"),
    ([{"role": "user", "content": "a"}], "the last message is the user's"),
    ([{"role": "user", "content": "bad \ud800"}, {"role": "assistant", "content": "b"}],
     "not valid Unicode"),
])
def test_a_loaded_conversation_is_checked(data, fragment):
    with pytest.raises(RequestError) as bad:
        parse_conversation(data, "chat.json")
    assert fragment in str(bad.value) and "\n" not in str(bad.value)
    assert str(bad.value).startswith("chat.json")


def test_load_of_a_file_that_is_not_json_is_one_line(llm, tmp_path):
    session = ChatSession(llm, GREEDY)
    (tmp_path / "x.json").write_text("{not json")
    for path, fragment in ((tmp_path / "x.json", "is not a JSON file"),
                           (tmp_path / "none.json", "cannot read")):
        with pytest.raises(RequestError, match=fragment):
            session.load(str(path))
    assert session.history == []


def test_set_checks_names_and_values(llm):
    session = ChatSession(llm, GREEDY)
    assert session.set("temperature", "0.5") == "temperature = 0.5"
    assert session.set("top_k", "40") == "top_k = 40"
    assert session.params.temperature == 0.5 and session.params.top_k == 40
    for name, value, message in [("temperature", "hot", "must be a number, got 'hot'"),
                                 ("temperature", "-1", "-1"), ("top_p", "2", "top_p"),
                                 ("top_k", "1.5", "must be an integer"),
                                 ("max_tokens", "0", "max_tokens"), ("colour", "1", "colour")]:
        with pytest.raises(RequestError, match=message):
            session.set(name, value)
    assert session.params.temperature == 0.5  # unchanged by the bad values
    # a max_tokens that fills the context alone, refused as chat's --max-tokens is
    limit = session.context_limit
    with pytest.raises(RequestError) as refused:
        session.set("max_tokens", str(limit))
    assert str(refused.value) == (f"max_tokens {limit} leaves no room for a message: the "
                                  f"context holds {limit} tokens, the conversation and the "
                                  f"reply together; ask for fewer than {limit}")
    assert session.params.max_tokens == GREEDY.max_tokens
    assert session.set("max_tokens", str(limit - 1)) == f"max_tokens = {limit - 1}"


def test_multi_line_input():
    def reader(lines):
        it = iter(lines)
        return lambda prompt: next(it)

    assert read_message(reader(["plain"]), ">", "...") == ("plain", False)
    assert read_message(reader(["/stats"]), ">", "...") == ("/stats", False)
    assert read_message(reader(['"""one', "two", 'three"""']), ">", "...") == ("one\ntwo\nthree", True)
    assert read_message(reader(['"""', "a", "", "b", '"""']), ">", "...") == ("a\n\nb", True)
    assert read_message(reader(['"""inline"""']), ">", "...") == ("inline", True)
    # a block is a message whatever it starts with: run_terminal runs no command for it
    assert read_message(reader(['"""/usr/bin is', 'a folder"""']), ">", "...") == \
        ("/usr/bin is\na folder", True)

    def ends_with_ctrl_d(lines):
        it = iter(lines)

        def read(prompt):
            line = next(it, None)
            if line is None:
                raise EOFError
            return line
        return read

    # Ctrl-D inside a block sends what was typed; at the first prompt it is EOF
    assert read_message(ends_with_ctrl_d(['"""one', "two"]), ">", "...") == ("one\ntwo", True)
    assert read_message(ends_with_ctrl_d(['"""']), ">", "...") == ("", True)
    with pytest.raises(EOFError):
        read_message(ends_with_ctrl_d([]), ">", "...")


def test_a_block_that_starts_with_a_slash_is_a_message(llm):
    """At the terminal, /stats is a command but a triple-quoted block starting with a slash
    (a pasted path) goes to the model."""
    import io

    from rich.console import Console

    from cupy_llama.cli.chat_ui import run_terminal
    lines = iter(['"""/stats"""', "/stats"])

    def read_line(prompt):
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line
    session = ChatSession(llm, GREEDY)
    out, err = io.StringIO(), io.StringIO()
    assert run_terminal(session, Console(file=out), Console(file=err), read_line=read_line) == 0
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["/stats"]
    assert "1 reply," in out.getvalue() + err.getvalue()  # the second /stats, a command


def test_printable_hides_terminal_controls():
    assert printable("a\x1b[2Jb\r\tc\nd\x07") == "a\ufffd[2Jb\ufffd\tc\nd\ufffd"


# ---- stdin is not a terminal -----------------------------------------------------------------

def chat_cli(model_dir, *args, stdin):
    return subprocess.run([sys.executable, "-m", "cupy_llama.cli", "chat", "--model",
                           str(model_dir), "--device", "cpu", "--temperature", "0",
                           "--max-tokens", "12", *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def test_pipe_mode_prints_only_the_answer(model_dir, llm):
    result = chat_cli(model_dir, "--system", "Be brief.", stdin="What is two\nplus two?\n")
    assert result.returncode == 0, result.stderr
    # the newline `echo` adds is not part of the message
    want = reply_text(llm, [{"role": "system", "content": "Be brief."},
                            user("What is two\nplus two?")])
    assert result.stdout == want + "\n"
    assert "tok/s" in result.stderr and "tok/s" not in result.stdout


def test_pipe_mode_with_empty_stdin_is_an_error(model_dir):
    result = chat_cli(model_dir, stdin="")
    assert result.returncode == 2 and "stdin is empty" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_without_a_chat_template_is_refused_with_the_way_out(tmp_path):
    """chat needs the template: a model without one gets that said once it loads, with the
    command that sends plain prompts, not an error about messages it cannot avoid."""
    from cupy_llama.bench.random_model import make_random_model
    folder = make_random_model(tmp_path / "model", "tiny", architectures=["Qwen2ForCausalLM"])
    for name in ("chat_template.jinja", "tokenizer_config.json"):  # its template's places
        (folder / name).unlink()
    result = chat_cli(folder, "Hi", stdin="")
    assert result.returncode == 1, result.stderr
    assert "no chat template" in result.stderr and "generate --raw" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_with_named_templates_and_no_default_is_refused_naming_them(tmp_path):
    """A tokenizer_config.json list of templates without "default" loads, but chat needs
    one: the refusal names them and says how to pick one."""
    import json
    from cupy_llama.bench.random_model import make_random_model
    folder = make_random_model(tmp_path / "model", "tiny", architectures=["Qwen2ForCausalLM"])
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = chat_cli(folder, "Hi", stdin="")
    assert result.returncode == 1, result.stderr
    assert "lists chat templates ('tool_use') but none named 'default'" in result.stderr
    assert "chat_template.jinja" in result.stderr and "Traceback" not in result.stderr


def test_a_reply_is_as_long_as_max_new_tokens_says_unless_max_tokens_is_given(model_dir, tmp_path):
    """generation_config.json's max_new_tokens is chat's reply length where --max-tokens is
    left out (in place of chat's own 1,024)."""
    import json
    import shutil
    folder = tmp_path / "short"
    shutil.copytree(model_dir, folder)
    gen_path = folder / "generation_config.json"
    gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), "max_new_tokens": 3}))
    for flags, length in (([], 3), (["--max-tokens", "5"], 5)):
        # (min tokens as many: end-of-sequence held off)
        result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "chat", "--model",
                                 str(folder), "--device", "cpu", "--temperature", "0",
                                 "--min-tokens", str(length), *flags, "Hi"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert f"tok/s, {length} tokens (stopped at the token limit)" in result.stderr, result.stderr


def test_a_prompt_argument_is_answered_once(model_dir, llm):
    # stdin is not read when PROMPT is given (a script's loop over its own stdin keeps it)
    result = chat_cli(model_dir, "--system", "Be brief.", "What is two plus two?",
                      stdin="this is not the message\n")
    assert result.returncode == 0, result.stderr
    want = reply_text(llm, [{"role": "system", "content": "Be brief."},
                            user("What is two plus two?")])
    assert result.stdout == want + "\n"
    assert "tok/s" in result.stderr and "tok/s" not in result.stdout
    empty = chat_cli(model_dir, "  ", stdin="")
    assert empty.returncode == 2 and "PROMPT is empty" in empty.stderr
    assert "loading" not in empty.stderr  # refused before the model loads


def test_a_dash_prompt_reads_the_message_from_stdin(model_dir, llm):
    """PROMPT -, as generate's --input - takes it: the message is stdin, not "-"."""
    result = chat_cli(model_dir, "-", stdin="What is two plus two?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == reply_text(llm, [user("What is two plus two?")]) + "\n"
    empty = chat_cli(model_dir, "-", stdin="")
    assert empty.returncode == 2 and "stdin is empty" in empty.stderr


# ---- the interactive terminal ----------------------------------------------------------------
#
# Every step waits for what the chat shows (a prompt, a reply's first words, a note), never
# for a time; the timeout is only the ceiling for a chat that never shows it.

PROMPT = ">>> "
CEILING_S = 120
SGR = re.compile(r"\x1b\[[0-9;]*m")   # colour and style codes


def spawn(model_dir, *args, cache=None, env=None, preexec_fn=None):
    pexpect = pytest.importorskip("pexpect")  # in the test extra; only these tests need it
    # os.environ, not the process's C environment (pexpect's default): GNU readline, once
    # loaded in the test process, exports COLUMNS=80 there, and rich would wrap at 80
    # columns instead of the terminal's 200
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    environment.update({"TERM": "xterm-256color", **(env or {})})
    if cache is not None:
        environment["CUPY_LLAMA_CACHE"] = str(cache)
    child = pexpect.spawn(sys.executable, ["-m", "cupy_llama.cli", "chat", "--model",
                                           str(model_dir), "--device", "cpu", *args],
                          encoding="utf-8", codec_errors="replace", timeout=CEILING_S,
                          dimensions=(40, 200), env=environment, preexec_fn=preexec_fn)
    child.expect_exact(PROMPT)
    return child


def ask(child, text, stats=r"\x1b\[2m\d+ ms to first token"):
    """Send a message; return the reply as shown (up to the statistics line)."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")
    child.expect(stats)
    reply = child.before.replace("\r\n", "\n")
    child.expect_exact(PROMPT)
    assert reply.endswith("\n")
    return reply[:-1]


def finish(child, status):
    child.expect(pytest.importorskip("pexpect").EOF)
    child.close()
    assert child.exitstatus == status


def leave_with_two_ctrl_c(child):
    """At the prompt: the first Ctrl-C warns, the second leaves with 130."""
    child.sendintr()
    child.expect_exact("press Ctrl-C again")
    child.expect_exact(PROMPT)
    child.sendintr()
    finish(child, 130)


def test_terminal_chat_streams_keeps_history_and_takes_commands(model_dir, llm, tmp_path):
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "12", cache=tmp_path)
    first = ask(child, "hello")
    want_first = reply_text(llm, [user("hello")])
    assert first == printable(want_first)
    second = ask(child, "more")
    assert second == printable(reply_text(llm, [user("hello"), {"role": "assistant",
                                                "content": want_first}, user("more")]))
    child.sendline("/clear")
    child.expect_exact("conversation cleared")
    child.expect_exact(PROMPT)
    assert ask(child, "hello") == first
    child.sendline("/set temperature warm")
    child.expect_exact("temperature must be a number, got 'warm'")
    child.expect_exact(PROMPT)
    child.sendline("/set max_tokens 3")
    child.expect_exact("max_tokens = 3")
    child.expect_exact(PROMPT)
    child.sendline("/clear")
    child.expect_exact(PROMPT)
    short = ask(child, "hello")
    assert short == printable(reply_text(llm, [user("hello")],
                                         SamplingParams(temperature=0, max_tokens=3)))
    child.sendline("/stats")
    child.expect(r"4 replies, \d+ tokens generated")
    child.expect_exact(PROMPT)
    child.sendline("/nope")
    child.expect_exact("unknown command /nope")
    child.expect_exact(PROMPT)
    child.sendeof()
    finish(child, 0)


def test_retry_save_load_and_help_at_the_terminal(model_dir, llm, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=6)
    hello = reply_text(llm, [user("hello")], params)
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "6", cache=tmp_path)
    child.sendline("/help")
    for command in ("/retry", "/save FILE", "/load FILE", "Ctrl-D also ends it"):
        child.expect_exact(command)
    child.expect_exact(PROMPT)
    child.sendline("/retry")
    child.expect_exact("nothing to retry yet")
    child.expect_exact(PROMPT)
    assert ask(child, "hello") == printable(hello)
    child.sendline("/retry")
    child.expect_exact("/retry\r\n")
    # greedy repeats the reply: the chat says so and names the way out
    child.expect_exact("gives the same reply again; /set temperature 0.7 samples a different one)")
    child.expect(r"\x1b\[2m\d+ ms to first token")
    assert child.before.replace("\r\n", "\n").strip("\n") == printable(hello)
    child.expect_exact(PROMPT)
    saved = tmp_path / "chat.json"
    child.sendline(f"/save {saved}")
    child.expect_exact(f"saved 2 messages to {saved}")
    child.expect_exact(PROMPT)
    child.sendline("/clear")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {saved}")
    child.expect_exact(f"loaded 2 messages from {saved} (no system prompt)")
    child.expect_exact(PROMPT)
    want = reply_text(llm, [user("hello"), {"role": "assistant", "content": hello},
                            user("next")], params)
    assert ask(child, "next") == printable(want)
    (tmp_path / "bad.json").write_text('[{"role": "user", "content": "a"}]')
    child.sendline(f"/load {tmp_path / 'bad.json'}")
    child.expect_exact("the last message is the user's")
    child.expect_exact(PROMPT)
    child.sendline("/system")
    child.expect_exact("there is no system prompt to remove; /system TEXT sets one")
    child.expect_exact(PROMPT)
    # a fixed seed repeats the reply too: the chat names that way out
    for setting in ("/set temperature 1", "/set seed 3"):
        child.sendline(setting)
        child.expect_exact(PROMPT)
    child.sendline("/retry")
    child.expect_exact("(the fixed seed 3 gives the same reply again; /set seed -1 samples a "
                       "different one)")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    finish(child, 0)
    assert json.loads(saved.read_text()) == [user("hello"),
                                             {"role": "assistant", "content": hello}]


def test_input_history_is_kept_across_sessions(model_dir, tmp_path):
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "3", cache=tmp_path)
    first = ask(child, "remember this line")
    child.sendline("/stats")
    child.expect_exact(PROMPT)
    child.sendeof()
    finish(child, 0)
    assert (tmp_path / "chat_history").read_text().splitlines()[-2:] == [
        "remember this line", "/stats"]
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "3", cache=tmp_path)
    child.send("\x1b[A\x1b[A")   # Up twice: the message before /stats
    child.expect_exact("remember this line")
    child.send("\r")
    child.expect(r"\x1b\[2m\d+ ms to first token")
    assert child.before.replace("\r\n", "\n").endswith(first + "\n")
    child.expect_exact(PROMPT)
    child.sendeof()
    finish(child, 0)


def test_a_history_file_that_cannot_be_written_does_not_stop_the_chat(model_dir, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")   # the cache folder would be inside a file
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "3", cache=blocked)
    ask(child, "hi")
    child.sendeof()
    finish(child, 0)
    assert blocked.read_text() == "not a folder"


def test_ctrl_d_inside_a_block_sends_what_was_typed(model_dir, llm, tmp_path):
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "12", cache=tmp_path)
    child.sendline('"""first line')
    child.expect_exact("... ")
    child.sendline("second line")
    child.expect_exact("... ")
    child.sendeof()
    child.expect(r"\x1b\[2m\d+ ms to first token")
    shown = SGR.sub("", child.before).replace("\r\n", "\n").strip("\n")  # after "... "
    assert shown == printable(reply_text(llm, [user("first line\nsecond line")]))
    child.expect_exact(PROMPT)   # the chat goes on; Ctrl-D at the prompt leaves
    child.sendeof()
    finish(child, 0)


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_colour_when_asked_or_when_the_terminal_has_none(model_dir, tmp_path, env):
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "3", cache=tmp_path,
                  env=env)
    shown = child.before + child.after
    ask(child, "hi", stats=r"\d+ ms to first token, [\d.]+ tok/s")
    shown += child.before + child.after
    child.sendeof()
    finish(child, 0)
    shown += child.before
    assert "Type a message" in shown and not SGR.search(shown), repr(shown)


@pytest.fixture(scope="module")
def endless_model_dir(model_dir, tmp_path_factory):
    """The model with the embedding rows of its EOS tokens zeroed (tied embeddings: their
    logits are 0), so a greedy reply never ends on its own."""
    import shutil
    from cupy_llama.checkpoint import write_safetensors
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint

    out = tmp_path_factory.mktemp("endless") / "model"
    shutil.copytree(model_dir, out)
    config = read_config(model_dir)
    with open_checkpoint(model_dir, model_for(config)) as checkpoint:
        tensors = {name: checkpoint.read(name).copy() for name in checkpoint.tensors}
    eos_ids = sorted(LLM(model_dir, device="cpu", log=None).engine.eos_token_ids)
    tensors["model.embed_tokens.weight"][eos_ids] = 0
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    return out


def first_words(model_dir, message):
    """The first characters the terminal shows of the greedy reply to message: seeing them
    is seeing the reply under way."""
    llm = LLM(model_dir, device="cpu", log=None)
    text = printable(reply_text(llm, [user(message)], SamplingParams(temperature=0,
                                                                      max_tokens=8)))
    assert text.strip(), "the reply starts with nothing visible"
    return text.replace("\n", "\r\n")[:8]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(endless_model_dir, tmp_path):
    message = "tell me everything"
    start = first_words(endless_model_dir, message)
    child = spawn(endless_model_dir, "--temperature", "0", "--max-tokens", "8000",
                  cache=tmp_path)
    child.sendline(message)
    child.expect_exact(message + "\r\n")
    child.expect_exact(start)  # the reply is under way
    child.sendintr()
    child.expect_exact("reply stopped")
    child.expect(r"ms to first token, [\d.]+ tok/s, (\d+) tokens?")
    assert 0 < int(child.match.group(1)) < 8000
    child.expect_exact(PROMPT)
    child.sendline("/set max_tokens 4")
    child.expect_exact(PROMPT)
    ask(child, "still there?")  # the history with the stopped reply is still a valid chat
    child.sendline("/stats")
    child.expect(r"2 replies")
    child.expect_exact(PROMPT)
    leave_with_two_ctrl_c(child)


def test_single_ctrl_c_at_the_prompt_does_not_exit(model_dir, tmp_path):
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "3", cache=tmp_path)
    child.sendintr()
    child.expect_exact("press Ctrl-C again")
    child.expect_exact(PROMPT)
    ask(child, "hi")   # a message in between resets the count
    child.sendintr()
    child.expect_exact("press Ctrl-C again")
    child.expect_exact(PROMPT)
    child.sendline("/bye")
    finish(child, 0)


def test_ctrl_c_works_when_the_chat_was_started_with_sigint_ignored(endless_model_dir,
                                                                    tmp_path):
    """A shell starts background jobs with SIGINT ignored, and the processes they start
    (a test run's pexpect children too) inherit that; Python then installs no handler of
    its own. The chat takes Ctrl-C all the same: at the prompt and during a reply."""
    message = "tell me everything"
    start = first_words(endless_model_dir, message)
    child = spawn(endless_model_dir, "--temperature", "0", "--max-tokens", "8000",
                  cache=tmp_path,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child.sendintr()
    child.expect_exact("press Ctrl-C again")
    child.expect_exact(PROMPT)
    child.sendline(message)
    child.expect_exact(start)
    child.sendintr()
    child.expect_exact("reply stopped")
    child.expect_exact(PROMPT)
    leave_with_two_ctrl_c(child)


def test_a_full_context_at_the_terminal(endless_model_dir, tmp_path):
    # 150 tokens fit the context of 160 alone (more is refused), not beside the prompt
    child = spawn(endless_model_dir, "--temperature", "0", "--max-tokens", "150",
                  "--max-model-len", "160", cache=tmp_path)
    child.sendline("tell me a long story")
    child.expect_exact("stopped at the context limit of 160 tokens")
    child.expect_exact(PROMPT)
    child.sendline("and then?")
    child.expect_exact("(dropped the oldest turn to fit the context of 160 tokens; the "
                       "system prompt stays)")
    child.expect(r"ms to first token")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect_exact("2 replies")
    child.expect_exact(PROMPT)
    child.sendeof()
    finish(child, 0)


def test_stats_count_the_context_in_use_and_clear_empties_it(llm):
    # a reply of exactly 5 tokens; the context after it is the last prompt (the whole
    # conversation through the chat template) and that reply, not a sum over the turns
    session = ChatSession(llm, replace(GREEDY, max_tokens=5, ignore_eos=True))
    before, prompts = llm.stats(), []
    for text in ("hello", "and again"):
        prompts.append(llm.tokenizer.encode_chat(session.messages(text), add_generation_prompt=True))
        for _ in session.reply(text):
            pass
    prompt = prompts[-1]
    assert f"context: {len(prompt) + 5} of" in session.stats()
    # the second turn found the first turn's full blocks in the prefix cache, and the
    # statistics say so from the engine's own counts
    after = llm.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(map(len, prompts))
    assert after.prefix_cache_hits - before.prefix_cache_hits >= len(prompts[0]) // 16 * 16 > 0
    assert (f"prefix cache: {after.prefix_cache_hits} of {after.prefix_cache_queries} prompt "
            "tokens came from earlier turns") in session.stats()
    session.clear()
    assert f"context: 0 of {llm.max_model_len} tokens in use" in session.stats()


# ---- tools (--tools) -------------------------------------------------------------------------

TOOL_PARAMS = SamplingParams(temperature=0, max_tokens=300)
SINGLE_CALL = dict(tool_choice="required", parallel_tool_calls=False)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    pytest.importorskip("llguidance")
    from conftest import make_tool_model
    return make_tool_model(tmp_path_factory.mktemp("hermes"), "hermes")


@pytest.fixture(scope="module")
def tool_llm(tool_model_dir):
    llm = LLM(tool_model_dir, device="cpu", log=None)
    yield llm
    llm.close()


def tool_session(tool_llm, **choice):
    from conftest import TOOLS
    from cupy_llama.cli.chat_ui import ChatTools
    return ChatSession(tool_llm, TOOL_PARAMS, tools=ChatTools(TOOLS, **choice))


def test_tool_choice_none_shows_the_tools_and_answers_as_llm_chat(tool_llm):
    """--tool-choice none: the template sees the tools (one prompt prefix whatever the
    choice, as OpenAI's model and vLLM's prompt see them); the reply is never a call."""
    from conftest import QUESTION, TOOLS
    session = tool_session(tool_llm, tool_choice="none")
    shown = "".join(session.reply(QUESTION[0]["content"]))
    want = tool_llm.chat(QUESTION, TOOL_PARAMS, tools=TOOLS, tool_choice="none")
    assert want.tool_calls is None and shown == want.text
    assert session.history[1] == {"role": "assistant", "content": want.text}
    assert session.turns[-1].prompt_tokens == len(want.prompt_token_ids)
    assert want.prompt_token_ids == tool_llm.chat(QUESTION, replace(TOOL_PARAMS, max_tokens=1),
                                                  tools=TOOLS).prompt_token_ids


def test_a_reply_with_calls_shows_the_calls_and_keeps_them_in_the_history(tool_llm):
    from conftest import QUESTION, TOOLS
    session = tool_session(tool_llm, **SINGLE_CALL)
    shown = "".join(session.reply(QUESTION[0]["content"]))
    want = tool_llm.chat(QUESTION, TOOL_PARAMS, tools=TOOLS, **SINGLE_CALL)
    (call,) = want.tool_calls
    assert want.finish_reason == "tool_calls" and want.content is None
    # the call, one marked line with its arguments on one line, never the model's raw text
    assert "<tool_call>" not in shown and "<tool_call>" in want.text
    (line,) = shown.splitlines()
    assert line.startswith("tool call call_") and line.endswith(
        f": {call.name} {json.dumps(json.loads(call.arguments), ensure_ascii=False)}")
    assert session.history[0] == QUESTION[0]
    (made,) = session.history[1]["tool_calls"]
    assert session.history[1]["content"] is None and line.startswith(f"tool call {made['id']}:")
    assert (made["function"]["name"], made["function"]["arguments"]) == (call.name, call.arguments)
    assert session.waiting_calls() == [made]
    with pytest.raises(RequestError, match="wait for their results"):
        "".join(session.reply("and now?"))
    with pytest.raises(RequestError, match="no waiting tool call has the id or name 'nope'"):
        "".join(session.tool_result("nope", "x"))
    # /retry asks for the calls again: greedy, the same call with a new id
    again = "".join(session.retry())
    assert again.split(":", 1)[1] == line.split(":", 1)[1]
    assert len(session.history) == 2 and session.history[1]["tool_calls"][0]["id"] != made["id"]
    (made,) = session.waiting_calls()

    # the result, answered by the model: the same reply as LLM.chat gives that exchange
    session.tools = replace(session.tools, tool_choice="auto")
    answer = "".join(session.tool_result(call.name, "22C and sunny"))
    exchange = session.history[:2] + [{"role": "tool", "tool_call_id": made["id"],
                                       "content": "22C and sunny"}]
    assert session.history[:3] == exchange
    want = tool_llm.chat(exchange, TOOL_PARAMS, tools=TOOLS)
    assert want.tool_calls is None and answer == want.text
    assert session.history[3] == {"role": "assistant", "content": answer}
    assert "22C and sunny" in tool_llm.tokenizer.decode(want.prompt_token_ids)
    assert session.turns[-1].prompt_tokens == len(want.prompt_token_ids)
    assert session.waiting_calls() == []
    with pytest.raises(RequestError, match="no tool call is waiting"):
        "".join(session.tool_result(call.name, "again"))

    # /retry answers the tool result again; /save and /load keep the calls and results
    again = "".join(session.retry())
    assert again == answer and session.history[:3] == exchange and len(session.history) == 4
    system, history = parse_conversation(json.loads(json.dumps(session.conversation())), "f")
    assert system is None and history == session.history


def test_a_reply_cut_off_inside_a_call_shows_the_text_it_got_to(tool_llm):
    """The stream has sent the call's name and arguments as tool-call deltas, but with no
    closed call there is no call line to show: the chat shows the reply's text."""
    from conftest import QUESTION, TOOLS
    from cupy_llama.cli.chat_ui import ChatTools
    no_whitespace = {token_id: -100 for token_id in (9, 10, 13, 32)}  # names come sooner
    params = replace(TOOL_PARAMS, logit_bias=no_whitespace)
    whole = tool_llm.chat(QUESTION, params, tools=TOOLS, **SINGLE_CALL)
    assert whole.finish_reason == "tool_calls"
    params = replace(params, max_tokens=len(whole.token_ids) - 3)  # inside the arguments
    want = tool_llm.chat(QUESTION, params, tools=TOOLS, **SINGLE_CALL)
    assert want.finish_reason == "length" and want.tool_calls is None
    assert want.content.startswith('<tool_call>\n{"name":') and '"arguments":' in want.content
    session = ChatSession(tool_llm, params, tools=ChatTools(TOOLS, **SINGLE_CALL))
    assert "".join(session.reply(QUESTION[0]["content"])) == want.content
    assert session.history[1] == {"role": "assistant", "content": want.content}
    assert session.waiting_calls() == []


def test_a_reply_with_two_calls_waits_for_both_results(tool_llm):
    from conftest import QUESTION, TOOLS
    session = tool_session(tool_llm)
    calls = [{"id": f"call_{n}", "type": "function",
              "function": {"name": name, "arguments": arguments}}
             for n, (name, arguments) in enumerate([("get_weather", '{"city": "Paris"}'),
                                                    ("get_time", '{"zone": "CET"}')])]
    session.history = [QUESTION[0], {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(RequestError, match="no waiting tool call has the id or name"):
        "".join(session.tool_result("get_clock", "x"))
    assert "".join(session.tool_result("get_time", "09:00")) == ""  # one still waits
    assert session.waiting_calls() == [calls[0]] and not session.turns
    "".join(session.tool_result("call_0", "22C"))
    assert [m["role"] for m in session.history] == ["user", "assistant", "tool", "tool",
                                                    "assistant"]
    assert [m.get("tool_call_id") for m in session.history[2:4]] == ["call_1", "call_0"]
    # the model answered both results at once
    prompt = tool_llm.tokenizer.encode_chat(session.history[:4], add_generation_prompt=True,
                                            tools=TOOLS)
    assert session.turns[-1].prompt_tokens == len(prompt)
    assert "09:00" in tool_llm.tokenizer.decode(prompt) and "22C" in tool_llm.tokenizer.decode(prompt)
    twice = {**calls[1], "id": "call_2"}
    session.history = session.history[:1] + [{"role": "assistant", "content": None,
                                               "tool_calls": [calls[1], twice]}]
    with pytest.raises(RequestError, match="several waiting calls are to 'get_time'"):
        "".join(session.tool_result("get_time", "x"))


# the tool template's prompt holds about 1000 tokens, an old turn about 260: room for one
# old turn, and for none
@pytest.mark.parametrize("limit", [1400, 1200])
def test_a_tool_result_in_a_full_context_drops_only_older_turns(tool_model_dir, limit):
    from conftest import QUESTION, TOOLS
    from cupy_llama.cli.chat_ui import ChatTools
    max_tokens = 24
    small = LLM(tool_model_dir, device="cpu", log=None, max_model_len=limit)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    session = ChatSession(small, params, tools=ChatTools(TOOLS))
    old = [user("an old question " * 8), {"role": "assistant", "content": "an old answer " * 8}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    current = [QUESTION[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    session.history = old * 3 + current
    notes = []
    "".join(session.tool_result("call_1", "22C", on_drop=notes.append))
    result = {"role": "tool", "tool_call_id": "call_1", "content": "22C"}
    kept = session.history[:-2]
    # the newest turns that leave room, and always the turn the result answers
    assert kept[-2:] == current and session.history[-2] == result
    assert kept[:-2] == (old * 3)[len(old * 3) - len(kept[:-2]):] and notes
    assert len(kept[:-2]) == (2 if limit == 1400 else 0)
    assert sum(notes) == (6 - len(kept[:-2])) // 2
    prompt = small.tokenizer.encode_chat(kept + [result], add_generation_prompt=True,
                                         tools=TOOLS)
    assert session.turns[-1].prompt_tokens == len(prompt)
    assert len(prompt) + max_tokens <= limit
    one_more = (old * 3)[len(old * 3) - len(kept[:-2]) - 2:]  # no more turns than needed went
    longer = small.tokenizer.encode_chat(one_more + current + [result],
                                         add_generation_prompt=True, tools=TOOLS)
    assert len(longer) + max_tokens > limit
    small.close()


def test_chat_with_tools_on_the_command_line(tool_model_dir, tool_llm, tmp_path):
    from conftest import QUESTION, TOOLS
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    result = chat_cli(tool_model_dir, "--max-tokens", "300", "--tools", str(tools),
                      "--tool-choice", "get_time", "--no-parallel-tool-calls",
                      QUESTION[0]["content"], stdin="")
    assert result.returncode == 0, result.stderr
    want = tool_llm.chat(QUESTION, TOOL_PARAMS, tools=TOOLS, parallel_tool_calls=False,
                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = want.tool_calls
    assert re.fullmatch(rf"tool call call_\w+: get_time {re.escape(json.dumps(json.loads(call.arguments), ensure_ascii=False))}\n",
                        result.stdout)


@pytest.mark.parametrize("content, args, fragment", [
    ("{", [], "is not JSON"),
    ("{}", [], "must hold a non-empty JSON list of OpenAI tools"),
    ('[{"type": "retrieval"}]', [], '[0].type must be "function"'),
    (None, ["--tool-choice", "get_clock"], "--tool-choice: 'get_clock' is none of auto, "
                                           "required, none or a tool of"),
    (None, ["--tool-call-parser", "xml"], "--tool-call-parser: unknown tool-call parser 'xml'"),
])
def test_bad_tool_options_are_refused_before_the_model_loads(tool_model_dir, tmp_path,
                                                             content, args, fragment):
    from conftest import TOOLS
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS) if content is None else content)
    result = chat_cli(tool_model_dir, "--tools", str(tools), *args, "hi", stdin="")
    assert result.returncode == 2 and fragment in result.stderr
    assert "loading" not in result.stderr and len(result.stderr.splitlines()) == 1
    alone = chat_cli(tool_model_dir, *args or ["--no-parallel-tool-calls"], "hi", stdin="")
    assert alone.returncode == 2 and "needs --tools FILE" in alone.stderr


def test_an_enforced_schema_that_does_not_compile_names_its_file_and_tool(tool_model_dir,
                                                                         tmp_path):
    pytest.importorskip("llguidance")
    from conftest import TOOLS
    tools = tmp_path / "tools.json"
    bogus = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}
    tools.write_text(json.dumps(TOOLS + [bogus]))
    result = chat_cli(tool_model_dir, "--tools", str(tools), "--tool-choice", "required",
                      "hi", stdin="")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: --tools: {tools}[2].function.parameters: the JSON "
                                    f"schema does not compile: "), result.stderr
    assert "loading" not in result.stderr
    auto = chat_cli(tool_model_dir, "--tools", str(tools), "--tool-choice", "get_time",
                    "--max-tokens", "2", "hi", stdin="")  # f is not enforced: it loads
    assert auto.returncode == 0, auto.stderr


def test_tools_need_a_template_with_a_tool_format(model_dir, tmp_path):
    """Usage errors found in the tokenizer's files, before the weights load: a template
    that cannot take tools (the built-in Llama 3 one), with a tool-call format named or
    not, and one that takes them but shows no format this engine knows, unless one is
    named."""
    import shutil

    from conftest import TOOLS
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    for named in ([], ["--tool-call-parser", "hermes"]):
        result = chat_cli(model_dir, "--tools", str(tools), *named, "hi", stdin="")
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith("error: --tools: chat template: the built-in Llama 3 "
                                        "chat format does not support tools"), result.stderr
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}")
    result = chat_cli(plain, "--tools", str(tools), "hi", stdin="")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        "error: --tools: the model's chat template shows no tool-call format"), result.stderr
    named = chat_cli(plain, "--tools", str(tools), "--tool-call-parser", "hermes",
                     "--max-tokens", "2", "hi", stdin="")
    assert named.returncode == 0, named.stderr


def test_tool_calls_at_the_terminal(tool_model_dir, tool_llm, tmp_path):
    from conftest import QUESTION, TOOLS
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    child = spawn(tool_model_dir, "--temperature", "0", "--max-tokens", "300", "--tools",
                  str(tools), "--tool-choice", "required", "--no-parallel-tool-calls",
                  cache=tmp_path)
    # the call's line, the statistics, then what the chat waits for
    shown = SGR.sub("", ask(child, QUESTION[0]["content"],
                            stats=r"\x1b\[2m\d+ ms to first token.*\r\n.*waiting for tool results"))
    (call,) = tool_llm.chat(QUESTION, TOOL_PARAMS, tools=TOOLS, **SINGLE_CALL).tool_calls
    match = re.fullmatch(r"tool call (call_\w+): (\w+) (.*)", shown)
    assert match and match[2] == call.name and json.loads(match[3]) == json.loads(call.arguments)
    child.sendline("and now?")
    child.expect_exact("the model's tool calls wait for their results")
    child.expect_exact(PROMPT)
    child.sendline("/tool")
    child.expect_exact("usage: /tool CALL RESULT")
    child.expect_exact(PROMPT)
    # the result goes in and the model answers it (here with another call, as required)
    reply = SGR.sub("", ask(child, f"/tool {match[1]} 22C and sunny"))
    assert re.fullmatch(r"tool call call_\w+: \w+ .*", reply)
    child.sendline("/help")
    child.expect_exact("/tool CALL RESULT")
    child.expect_exact(PROMPT)
    child.sendeof()
    finish(child, 0)

"""`cupy-llama generate` and `info` on a tiny random model, and the exit codes."""
import fcntl
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import one_error_line, read_jsonl

from cupy_llama import LLM, SamplingParams
from cupy_llama.cli import main
from cupy_llama.bench.random_model import make_random_model

CPU = ["--device", "cpu"]


def run_generate(model_dir, tmp_path, content: bytes, name="in.jsonl", *extra):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
                 str(out), *CPU, "--temperature", "0", "--max-tokens", "6", "--overwrite", *extra])
    lines = out.read_text(encoding="utf-8").splitlines()
    return code, [json.loads(line) for line in lines]


def expected(llm, prompt, **params):
    values = dict(temperature=0, max_tokens=6)
    values.update(params)
    return llm.generate(prompt, SamplingParams(**values))


@pytest.mark.parametrize("raw", [False, True])
def test_txt_with_crlf_bom_and_blank_lines(model_dir, llm, tmp_path, raw):
    """A line is a user message through the chat template (the model has one), or with
    --raw the prompt text itself."""
    content = "\ufeffhello there\r\n\r\n  \r\nsecond prompt\r\nthird\n".encode()
    code, rows = run_generate(model_dir, tmp_path, content, "in.txt", *(["--raw"] if raw else []))
    assert code == 0
    assert [r["id"] for r in rows] == [1, 4, 5]   # line numbers; blank lines skipped
    for row, line in zip(rows, ["hello there", "second prompt", "third"]):
        prompt = line if raw else llm.tokenizer.encode_chat([{"role": "user", "content": line}])
        want = expected(llm, prompt)
        assert row["text"] == want.text
        assert row["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                                "completion_tokens": 6}
        assert row["finish_reason"] == "length"


def test_jsonl_forms_errors_and_duplicates(model_dir, llm, tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    lines = [
        {"id": "a", "prompt": "first", "max_tokens": 3},
        {"prompt": "no id", "temperature": -1},                       # bad value
        "this is not json",
        {"id": "b", "messages": chat},
        {"id": "c", "messages": chat, "max_tokens": 2},
        {"id": "a", "prompt": "reused id"},                            # duplicate
        {"id": "d", "prompt": "x", "colour": "red"},                   # unknown field
        {"id": "e"},                                                   # no prompt
        ["a", "list"],
        {"id": "f", "prompt": "x" * 5000},                             # longer than the context
        "[" * 5000 + "]" * 5000,                                       # past Python's parser
        {"id": 7, "prompt": "numeric id", "stop": ["zz"]},
    ]
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    code, rows = run_generate(model_dir, tmp_path, text.encode())
    assert code == 1  # some requests failed
    assert [r["id"] for r in rows] == ["a", 2, 3, "b", "c", "a", "d", "e", 9, "f", 11, 7]
    ok = {i for i, r in enumerate(rows) if "error" not in r}
    assert ok == {0, 3, 4, 11}
    assert rows[0]["text"] == expected(llm, "first", max_tokens=3).text
    assert rows[3]["text"] == llm.chat(chat, SamplingParams(temperature=0, max_tokens=6)).text
    assert rows[4]["usage"]["completion_tokens"] == 2
    assert rows[11]["text"] == expected(llm, "numeric id", stop=["zz"]).text
    assert "line 11 nests arrays or objects too deeply" in rows[10]["error"]
    assert "-1" in rows[1]["error"] and "temperature" in rows[1]["error"]
    assert "not valid JSON" in rows[2]["error"]
    assert "duplicate id 'a'" in rows[5]["error"] and "line 1" in rows[5]["error"]
    assert "unknown field 'colour'; a line holds 'prompt' or 'messages'" in rows[6]["error"]
    assert "chat_template_kwargs" in rows[6]["error"] and "response_format" in rows[6]["error"]
    assert "prompt" in rows[7]["error"]
    assert rows[8]["error"] == "line 9 must be a JSON object, got an array"  # JSON's words
    assert "context limit" in rows[9]["error"]
    assert all(set(r) == {"id", "error"} for i, r in enumerate(rows) if i not in ok)


def test_chat_template_kwargs_reach_every_kind_of_chat_line(model_dir, tmp_path):
    """--chat-template-kwargs reaches .txt lines, plain chat lines and OpenAI chat lines; a
    line's own chat_template_kwargs go over it; a prompt line cannot take them."""
    import shutil
    flavoured = tmp_path / "model"
    shutil.copytree(model_dir, flavoured)
    (flavoured / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ flavour | default('') }}")
    llm = LLM(flavoured, device="cpu", log=None)
    chat = [{"role": "user", "content": "hi"}]

    def tokens(flavour):
        return len(llm.tokenizer.encode_chat(chat, template_kwargs={"flavour": flavour}))
    assert len({tokens(""), tokens("q"), tokens("x y z w")}) == 3
    flag = ["--chat-template-kwargs", '{"flavour": "q"}']
    lines = [{"id": "flag", "messages": chat},
             {"id": "own", "messages": chat, "chat_template_kwargs": {"flavour": "x y z w"}},
             {"id": "prompt", "prompt": "hi", "chat_template_kwargs": {"flavour": "x"}},
             {"id": "bad", "messages": chat, "chat_template_kwargs": {"messages": 1}}]
    code, rows = run_generate(flavoured, tmp_path, "\n".join(map(json.dumps, lines)).encode(),
                              "in.jsonl", *flag)
    assert code == 1
    assert [row["usage"]["prompt_tokens"] for row in rows[:2]] == [tokens("q"), tokens("x y z w")]
    assert "chat_template_kwargs needs 'messages'" in rows[2]["error"]
    assert "may not set 'messages'" in rows[3]["error"]
    code, rows = run_generate(flavoured, tmp_path, b"hi\n", "in.txt", *flag)
    assert code == 0 and rows[0]["usage"]["prompt_tokens"] == tokens("q")
    batch = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, **more}}
             for name, more in (("flag", {}), ("own", {"chat_template_kwargs": {"flavour": "x y z w"}}))]
    code, rows = run_generate(flavoured, tmp_path, "\n".join(map(json.dumps, batch)).encode(),
                              "in.jsonl", *flag)
    assert code == 0
    assert [row["response"]["body"]["usage"]["prompt_tokens"] for row in rows] == \
        [tokens("q"), tokens("x y z w")]
    llm.close()


def test_the_summary_counts_in_words():
    from cupy_llama.cli.batch_io import BatchSummary
    assert BatchSummary(num_requests=1, num_preemptions=1).line().endswith(", 1 preemption")
    assert BatchSummary(num_requests=2, num_preemptions=0).line().endswith(", 0 preemptions")
    one = BatchSummary(num_requests=1, prompt_tokens=1, completion_tokens=1).line()
    assert one.startswith("1 request (0 failed): 1 prompt token (0 cached, 0%) + 1 completion "
                          "token in "), one
    two = BatchSummary(num_requests=2, prompt_tokens=2, completion_tokens=0).line()
    assert "2 requests (0 failed): 2 prompt tokens (" in two and "+ 0 completion tokens" in two


def test_chat_template_kwargs_are_an_option_of_the_run(model_dir, tmp_path, capsys):
    """They shape the results, so a --resume with others is refused; with --raw a .txt
    file has no chat lines for them."""
    (tmp_path / "in.txt").write_text("hi\nthere\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"), *CPU,
            "--max-tokens", "2", "--output", str(out)]
    assert main(args + ["--chat-template-kwargs", '{"flavour": "q"}']) == 0
    out.write_text(out.read_text().splitlines()[0] + "\n")  # as if stopped after one line
    capsys.readouterr()
    assert main(args + ["--resume", "--chat-template-kwargs", '{"flavour": "r"}']) == 2
    line = capsys.readouterr().err.strip()
    assert "--resume with other options" in line and "--chat-template-kwargs" in line, line
    assert main(args + ["--resume", "--chat-template-kwargs", '{"flavour": "q"}']) == 0
    assert main(args + ["--raw", "--chat-template-kwargs", "{}", "--overwrite"]) == 2
    assert "which --raw leaves out" in capsys.readouterr().err


def test_plain_lines_say_what_stopped_them(model_dir, llm, tmp_path):
    """A plain line's stop_reason beside its finish_reason, LLM.generate's: the stop
    string or stop token id that ended the reply, null when none did."""
    free = expected(llm, "abc", max_tokens=12, ignore_eos=True)
    stop = next(c for c in free.text[1:] if c != "\ufffd")  # (the tiny model's text)
    token = next(t for t in free.token_ids[4:] if t not in free.token_ids[:4])
    fields = {"string": {"stop": [stop]}, "token": {"stop_token_ids": [token]}, "none": {}}
    lines = [{"id": name, "prompt": "abc", "max_tokens": 12, "ignore_eos": True, **more}
             for name, more in fields.items()]
    code, rows = run_generate(model_dir, tmp_path, "\n".join(map(json.dumps, lines)).encode())
    assert code == 0
    for row, (name, more) in zip(rows, fields.items()):
        want = expected(llm, "abc", max_tokens=12, ignore_eos=True, **more)
        assert (row["text"], row["finish_reason"], row["stop_reason"]) == \
            (want.text, want.finish_reason, want.stop_reason), name
    assert [row["stop_reason"] for row in rows] == [stop, token, None]


def test_plain_lines_give_the_logprobs_they_ask_for(model_dir, llm, tmp_path):
    """A plain line's logprobs and prompt_logprobs come back beside its text, the values
    LLM.generate gives (and text for each token), never dropped."""
    lines = [{"id": "g", "prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 2},
             {"id": "p", "prompt": "abc", "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
             {"id": "none", "prompt": "abc", "max_tokens": 1}]
    code, rows = run_generate(model_dir, tmp_path, "\n".join(map(json.dumps, lines)).encode())
    assert code == 0
    want = llm.generate("abc", SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    assert [e["token_id"] for e in rows[0]["logprobs"]] == want.token_ids
    for got, entry in zip(rows[0]["logprobs"], want.logprobs):
        assert got["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
        assert [(t["token_id"], t["token"]) for t in got["top_logprobs"]] == [
            (t, llm.tokenizer.decode([t], skip_special_tokens=False)
             if t < llm.tokenizer.vocab_size else "")  # a padded vocabulary's id: no text
            for t, _ in entry.top]
    scored = llm.generate("abc", SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    assert rows[1]["prompt_logprobs"][0] is None
    assert [e["token_id"] for e in rows[1]["prompt_logprobs"][1:]] == scored.prompt_token_ids[1:]
    assert "logprobs" not in rows[2] and "prompt_logprobs" not in rows[2]


def test_an_input_none_of_whose_lines_can_run_is_a_usage_error_before_loading(
        model_dir, tmp_path, capsys):
    """Every line unreadable (not JSON, not an object, a duplicate id), or OpenAI batch
    lines beside one that is not: nothing would run, so the model is not loaded."""
    path = tmp_path / "in.jsonl"
    cases = ((b"Tell me a story\nAnd another\n", "line 1 is not valid JSON (Expecting value "
              "at column 1) (1 other line cannot run either); for one prompt per line, give "
              "--format txt or name the file .txt"),
             (b'[1]\n{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n',
              "line 1 must be a JSON object, got an array (2 other lines cannot run either)"),
             (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
              b'{"prompt": "b"}\n', "line 2 is a plain request"))
    for content, words in cases:
        path.write_bytes(content)
        assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU]) == 2
        err = capsys.readouterr().err
        line = one_error_line(err)
        assert line.startswith(f"error: --input {str(path)!r}"), line
        assert words in line and "loading" not in err, line


def test_an_input_without_prompts_is_a_usage_error_before_loading(model_dir, tmp_path,
                                                                  capsys, monkeypatch):
    path = tmp_path / "in.jsonl"
    for content in (b"", b"\xef\xbb\xbf", b"\r\n\n  \n"):
        path.write_bytes(content)
        assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU]) == 2
        err = capsys.readouterr().err
        assert one_error_line(err) == (
            f"error: --input {str(path)!r} holds no prompts: it is empty or has only blank "
            "lines; write one prompt per line (.txt) or one JSON object per line (.jsonl)")
        assert "loading" not in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert main(["generate", "--model", str(model_dir), "--input", "-", "--format", "txt",
                 *CPU]) == 2
    assert "stdin (--input -) holds no prompts" in one_error_line(capsys.readouterr().err)


def test_stdout_output_and_summary(model_dir, tmp_path, capsys):
    path = tmp_path / "in.txt"
    path.write_text("one\ntwo\n")
    code = main(["generate", "--model", str(model_dir), "--input", str(path), *CPU,
                 "--temperature", "0", "--max-tokens", "4"])
    captured = capsys.readouterr()
    assert code == 0
    assert [json.loads(line)["id"] for line in captured.out.splitlines()] == [1, 2]
    assert "2 requests (0 failed)" in captured.err and "8 completion tokens" in captured.err


def test_example_files_parse(model_dir, tmp_path):
    from cupy_llama.cli.batch_io import read_requests
    examples = Path(__file__).parent.parent / "examples"
    for name, fmt in (("prompts.txt", "txt"), ("requests.jsonl", "jsonl"),
                      ("openai_batch.jsonl", "jsonl")):
        requests = read_requests((examples / name).read_bytes(), fmt)
        assert requests and all(r.error is None for r in requests), name


def test_info(model_dir, capsys):
    assert main(["info", "--model", str(model_dir), *CPU, "--num-kv-blocks", "10"]) == 0
    out = capsys.readouterr().out
    from cupy_llama.models import read_config
    config = read_config(model_dir)
    assert f"{config.num_parameters:,}" in out
    assert "10 blocks x 16 tokens = 160 tokens" in out
    assert "hidden 64, 2 layers, 4 heads (2 KV)" in out
    # on the CPU: no GPU figure, and the context the engine would run (160 tokens, not
    # max_model_len); the ids a reply ends at are the engine's, the tokenizer's included
    assert "on the GPU" not in out and "float32 on the CPU" in out
    assert "context       " in out and "160 tokens per sequence" in out
    from cupy_llama import LLM
    engine_eos = sorted(LLM(model_dir, device="cpu", log=None).engine.eos_token_ids)
    assert f"eos ids       {', '.join(map(str, engine_eos))}\n" in out


def test_info_says_an_image_text_model_runs_its_language_model(capsys):
    folder = Path(__file__).parent / "fixtures" / "arch_gemma3_vision"
    assert main(["info", "--model", str(folder), *CPU]) == 0
    out = capsys.readouterr().out
    assert "architecture  Gemma3ForConditionalGeneration (its language model; images are " \
           "not read)\n" in out


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "cupy_llama.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def _generate_args(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    return ["generate", "--model", str(model_dir), "--input", str(prompts), *CPU,
            "--max-tokens", "2"]


def test_missing_model_dir_is_one_line_exit_1(tmp_path):
    result = cli(*_generate_args(tmp_path / "nope", tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "does not exist" in one_error_line(result.stderr)


def test_an_output_that_cannot_be_written_is_refused_before_loading(tmp_path, capsys):
    # the model folder does not exist either: the output is checked first
    generate = _generate_args(tmp_path / "nope", tmp_path)
    assert main([*generate, "--output", str(tmp_path / "no-folder" / "out.jsonl")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --output: folder") and "does not exist" in line
    assert main([*generate, "--output", str(tmp_path / "p.txt" / "out.jsonl")]) == 2
    assert "is a file, not a folder" in one_error_line(capsys.readouterr().err)


def test_options_that_would_do_nothing_are_refused_before_loading(tmp_path, capsys):
    """--raw with a .jsonl file (its lines say prompt or messages) and --overwrite with
    the results going to stdout change nothing: refused, as --resume without --output is.
    The model folder does not exist: these are found first."""
    generate = _generate_args(tmp_path / "nope", tmp_path)
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "hi"}\n')
    jsonl = [*generate[:4], str(lines), *generate[5:]]
    assert main([*jsonl, "--raw", "--output", str(tmp_path / "o.jsonl")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --raw sends a .txt file's lines") and "leave --raw out" in line
    assert main([*generate, "--overwrite"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --overwrite replaces an --output file"), line
    assert main([*generate, "--raw", "--output", str(tmp_path / "o.jsonl")]) == 1  # no model
    assert "does not exist" in one_error_line(capsys.readouterr().err)


def test_a_jsonl_run_that_kept_raw_resumes_without_it(tmp_path):
    """Runs used to take --raw with a .jsonl file (doing nothing) and kept it among their
    options; their --resume, which may no longer give --raw, goes on."""
    from cupy_llama.cli.generate import _check_same_options, _options_path, _run_options
    from cupy_llama.errors import OptionError
    out = tmp_path / "out.jsonl"
    kept = _run_options(None, "jsonl", True, {"max_tokens": 4})
    _options_path(str(out)).write_text(json.dumps(kept))
    _check_same_options(str(out), _run_options(None, "jsonl", False, {"max_tokens": 4}))
    kept = _run_options(None, "txt", True, {"max_tokens": 4})  # a .txt run's --raw counts
    _options_path(str(out)).write_text(json.dumps(kept))
    with pytest.raises(OptionError, match=r"no --raw \(the first run: --raw\)"):
        _check_same_options(str(out), _run_options(None, "txt", False, {"max_tokens": 4}))


def test_bad_model_is_one_line_exit_1(model_dir, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text("{ not json")
    for args in (["info", "--model", str(broken)], ["chat", "--model", str(broken), *CPU]):
        result = cli(*args, stdin="hi")
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "config.json" in result.stderr.strip().splitlines()[-1]


def test_usage_errors_exit_2(model_dir, tmp_path):
    assert main(["generate", "--model", str(model_dir)]) == 2            # no --input
    assert main(["generate", "--model", str(model_dir), "--input",
                 str(tmp_path / "missing.txt")]) == 2
    assert main(["chat", "--device", "tpu"]) == 2
    assert main(["no-such-command"]) == 2
    # an option's value is checked before the model folder is read
    assert main(["info", "--model", str(tmp_path / "nope"), "--max-num-seqs", "0"]) == 2


def test_unknown_input_format_is_a_usage_error(model_dir, tmp_path, capsys):
    path = tmp_path / "prompts.csv"
    path.write_text("hi\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU]) == 2
    assert "--format" in capsys.readouterr().err


def test_review_fixes_bad_text_and_values_and_closed_pipes(tmp_path):
    """Lone surrogates (undecodable input) and out-of-range values are one-line errors for
    their own line; a bad command-line value fails before the model loads; a closed
    output pipe is not an error."""
    import subprocess
    import sys as _sys
    model = make_random_model(tmp_path / "m", "tiny", seed=0, num_hidden_layers=1)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"prompt":"ok"}\n{"prompt":"bad \\ud800"}\n{"prompt":"b","top_k":4294967296}\n'
                     '{"prompt":"c","top_p":1e-46}\n')
    run = [_sys.executable, "-m", "cupy_llama.cli", "generate", "--model", str(model),
           "--device", "cpu", "--max-tokens", "2", "--input"]
    result = subprocess.run(run + [str(jsonl)], capture_output=True, text=True)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert one_error_line(result.stderr).startswith("error: 3 of 4 requests failed")
    assert "text" in lines[0]
    assert "not valid Unicode" in lines[1]["error"]
    assert "top_k" in lines[2]["error"] and "top_p" in lines[3]["error"]

    bad = subprocess.run(run + [str(jsonl), "--top-k", "3000000000"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --top-k")
    assert "loading" not in bad.stderr  # refused before the model was read

    many = tmp_path / "many.txt"
    many.write_text("".join(f"prompt {i}\n" for i in range(40)))
    piped = subprocess.run(" ".join(run + [str(many)]) + " 2>/dev/null | head -1; "
                           "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                           capture_output=True, text=True)
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 1


def test_the_served_name_is_the_folder_s_as_given(tmp_path, monkeypatch):
    """A link to a model (a Hub snapshot, named by its hash) is served by the link's own
    name; "." by the current folder's."""
    from cupy_llama.cli.options import served_name
    target = tmp_path / "7ae5576f3c" / "snapshot"
    target.mkdir(parents=True)
    (tmp_path / "qwen-0.5b").symlink_to(target)
    assert served_name(str(tmp_path / "qwen-0.5b")) == "qwen-0.5b"
    assert served_name(str(tmp_path / "qwen-0.5b") + "/") == "qwen-0.5b"
    monkeypatch.chdir(target)
    assert served_name(".") == "snapshot"


def test_seed_minus_one_asks_for_a_fresh_seed_as_the_server_takes_it(model_dir, tmp_path):
    """--seed -1 and a line's "seed": -1 are no seed (vLLM's), as over HTTP: the run goes
    through, sampled."""
    code, rows = run_generate(model_dir, tmp_path,
                              b'{"prompt": "a", "temperature": 1}\n'
                              b'{"prompt": "b", "temperature": 1, "seed": -1}\n',
                              "in.jsonl", "--seed", "-1")
    assert code == 0 and [sorted(row) for row in rows] == [sorted(rows[0])] * 2, rows
    assert all("error" not in row for row in rows)


def test_bad_option_values_are_usage_errors_named_by_their_flag(model_dir, tmp_path, capsys):
    generate = _generate_args(model_dir, tmp_path)
    for extra, flag in ((["--max-tokens", "-1"], "--max-tokens"), (["--top-p", "1.5"], "--top-p"),
                        (["--max-model-len", "0"], "--max-model-len"), (["--seed", "-2"], "--seed"),
                        (["--gpu-memory-utilization", "7"], "--gpu-memory-utilization")):
        assert main([*generate, *extra]) == 2, extra
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"error: {flag} must be"), line
    assert main(["chat", "--model", str(model_dir), *CPU, "--temperature", "-1"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("error: --temperature must be")
    # the other settings a message names are flags too, and an empty --stop says so
    assert main([*generate, "--min-tokens", "5", "--max-tokens", "2"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: --min-tokens must be an integer from 0 to --max-tokens (2), got 5")
    assert main([*generate, "--stop", "end", "--stop", ""]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: --stop must be a non-empty string: the text that ends a reply")
    # a watchdog shorter than the engine's progress messages allow (a quarter of it)
    assert main(["serve", "--model", str(model_dir), *CPU, "--engine-timeout", "0.8"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--engine-timeout" in line and "0.8" in line, line
    # click's own usage errors are one line too, with where to look
    assert main([*generate, "--no-such-option"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--no-such-option" in line and "cupy-llama generate --help" in line


def test_a_logit_bias_outside_the_vocabulary_is_a_usage_error_before_loading(
        model_dir, tmp_path, capsys):
    """config.json's vocab_size is known before the weights are read: an id past it is the
    command line's mistake, for generate and chat alike (the ones that take --logit-bias)."""
    for command in (_generate_args(model_dir, tmp_path), ["chat", "--model", str(model_dir),
                                                           *CPU, "hi"]):
        assert main([*command, "--logit-bias", "3=1", "--logit-bias", "512=-100"]) == 2
        err = capsys.readouterr().err
        assert one_error_line(err) == (
            "error: --logit-bias names token id 512, outside the model's vocabulary of 512 "
            "tokens (ids 0 to 511); give ids below 512")
        assert "loading" not in err


def test_a_refused_generate_leaves_no_files_behind(model_dir, tmp_path):
    """The model's checks and its load come before generate writes anything: a refused
    run leaves neither the output nor its options file (OUTPUT.run.json) for --resume to
    find."""
    out = tmp_path / "out.jsonl"
    for extra in (["--logit-bias", "512=1"], ["--max-tokens", "4096"]):
        assert main([*_generate_args(model_dir, tmp_path), "--output", str(out), *extra]) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]
    # weights that fail only in the load (a tensor missing): nothing written either
    from cupy_llama.checkpoint import write_safetensors
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    broken = make_random_model(tmp_path / "models" / "broken", "tiny", seed=0,
                               num_hidden_layers=1)
    with open_checkpoint(broken, model_for(read_config(broken))) as checkpoint:
        tensors = {name: checkpoint.read(name).copy() for name in checkpoint.tensors
                   if name != "model.norm.weight"}
    write_safetensors(broken / "model.safetensors", tensors)
    assert main([*_generate_args(broken, tmp_path), "--output", str(out)]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "p.txt"]


def test_a_max_tokens_that_fills_the_context_is_a_usage_error_before_loading(
        model_dir, tmp_path, capsys):
    """--max-tokens stands for every line of generate and every reply of chat: one that
    leaves no room for a prompt in the context (the model's 4096 positions, or
    --max-model-len) can run no line, and no reply (chat would cap it unsaid)."""
    generate = _generate_args(model_dir, tmp_path)[:-2]  # without its --max-tokens
    chat = ["chat", "--model", str(model_dir), *CPU, "hi"]
    for extra, message in (
            (["--max-tokens", "4096"], "--max-tokens 4096 leaves no room for a prompt: the "
             "context holds 4096 tokens, prompt and reply together; ask for fewer than 4096"),
            (["--max-tokens", "2000", "--max-model-len", "1024"], "--max-tokens 2000 leaves "
             "no room for a prompt: the context holds 1024 tokens, prompt and reply together; "
             "ask for fewer than 1024, or raise --max-model-len (the model takes up to 4096)")):
        for command in (generate, chat):
            assert main([*command, *extra]) == 2, (command[0], extra)
            err = capsys.readouterr().err
            assert one_error_line(err) == "error: " + message and "loading" not in err
    # chat's own default (1024 tokens) beyond a smaller context is no mistake of the user's
    assert main([*chat, "--max-model-len", "512"]) == 0


def test_a_line_past_the_context_fails_alike_in_both_kinds_of_file(model_dir, tmp_path):
    """A max_tokens asked for, by the line or by --max-tokens, that the context cannot give
    beside the prompt: a plain line fails with the numbers the server's 400 names, as an
    OpenAI batch line does; a plain line that leaves max_tokens out ends at the context."""
    def run(name: str, lines: list, *extra) -> list:
        path, out = tmp_path / name, tmp_path / f"{name}.out"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
              str(out), *CPU, "--temperature", "0", "--max-model-len", "64", "--overwrite",
              *extra])
        return read_jsonl(out)

    def batch_line(custom_id: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "hi", **body}}

    plain = run("plain.jsonl", [{"prompt": "hi", "max_tokens": 63},
                                {"prompt": "hi", "ignore_eos": True}])
    batch = run("batch.jsonl", [batch_line("a", max_tokens=63)])
    message = batch[0]["error"]["message"]
    assert re.fullmatch(r"(\d+) prompt tokens? \+ max_tokens 63 = \d+ tokens, past the context "
                        r"limit of 64; ask for at most \d+ tokens or shorten the prompt", message)
    assert plain[0] == {"id": 1, "error": f"line 1: {message}"}
    prompt_tokens = int(message.split()[0])
    assert plain[1]["usage"] == {"prompt_tokens": prompt_tokens,
                                 "completion_tokens": 64 - prompt_tokens}
    assert plain[1]["finish_reason"] == "length"
    # --max-tokens is asked for on every line that leaves max_tokens out
    plain = run("plain.jsonl", [{"prompt": "hi"}, {"prompt": "hi", "max_tokens": None,
                                                    "ignore_eos": True}], "--max-tokens", "63")
    batch = run("batch.jsonl", [batch_line("a")], "--max-tokens", "63")
    assert plain[0]["error"] == f"line 1: {batch[0]['error']['message']}" == f"line 1: {message}"
    # a line's max_tokens null asks for none (vLLM's None): it ends at the context
    assert plain[1]["usage"]["completion_tokens"] == 64 - prompt_tokens


def test_a_model_given_as_an_argument_is_told_where_it_goes(model_dir, tmp_path, capsys):
    """`serve MODEL` (vLLM's spelling) and the like: a usage error that says the command
    takes the model as --model, for every command, before anything is read or built."""
    prompts = _generate_args(model_dir, tmp_path)[4]
    for command, hint in (
            (["serve"], "serve takes the model as --model PATH"),
            (["info"], "info takes the model as --model PATH"),
            (["generate", "--input", prompts], "generate takes the model as --model PATH "
                                               "and the prompts as --input FILE"),
            (["bench", "latency"], "bench takes one MODE and the model as --model PATH"),
            (["fetch-demo"], "fetch-demo takes the folder to build in as --out DIR")):
        for model in ("tiny", str(model_dir)):
            assert main([*command, model]) == 2, command
            assert one_error_line(capsys.readouterr().err) == (
                f"error: unexpected argument {model!r}; {hint} (see 'cupy-llama "
                f"{command[0]} --help')")
    # where an argument is taken: a model folder as chat's PROMPT or as bench's MODE
    assert main(["chat", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err) == (f"error: PROMPT {str(model_dir)!r} is a folder, not a "
                                   "message; chat takes the model as --model PATH: "
                                   f"cupy-llama chat --model {model_dir}")
    assert "loading" not in err and "demo" not in err
    assert main(["bench", str(model_dir)]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: Invalid value for 'MODE': {str(model_dir)!r} is a path, not a MODE; bench "
        f"takes the model as --model PATH: cupy-llama bench latency --model {model_dir} "
        "(see 'cupy-llama bench --help')")
    # a model file as chat's PROMPT: GGUF (by its name, even a missing one, or its magic
    # bytes), which no command loads (so --model is not offered), or a file of a model
    # folder, which --model takes
    gguf_refused = ("cupy-llama does not load GGUF (llama.cpp's format): pass a Hugging Face "
                    "model folder (config.json, tokenizer.json and .safetensors weights), such "
                    "as the model's release on the Hugging Face Hub")
    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"GGUF\x03\0\0\0")
    (tmp_path / "renamed.bin").write_bytes(b"GGUF\x03\0\0\0")
    for prompt in (str(tmp_path / "model.Q4_K_M.gguf"), str(tmp_path / "renamed.bin"),
                   "missing.gguf"):
        assert main(["chat", prompt]) == 2, prompt
        err = capsys.readouterr().err
        assert one_error_line(err) == (f"error: PROMPT {prompt!r} names a GGUF file, not a "
                                       f"message; {gguf_refused}")
        assert "loading" not in err and "demo" not in err
    for name in ("model.safetensors", "config.json"):
        prompt = str(model_dir / name)
        assert main(["chat", prompt]) == 2, prompt
        assert one_error_line(capsys.readouterr().err) == (
            f"error: PROMPT {prompt!r} is a file of a model folder, not a message; chat "
            f"takes the folder as --model PATH: cupy-llama chat --model {model_dir}")
    # a message that only mentions such a file is a message
    assert main(["chat", "--model", str(model_dir), *CPU, "--max-tokens", "1",
                 "What is in a .gguf"]) == 0
    capsys.readouterr()
    # a message of several words, unquoted
    assert main(["chat", "--model", str(model_dir), "Name", "three", "rivers."]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: unexpected arguments 'three', 'rivers.'; chat takes one PROMPT (quote a "
        "message of several words: cupy-llama chat 'Name three rivers.') and the model as "
        "--model PATH (see 'cupy-llama chat --help')")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line_exit_1(model_dir, tmp_path, capsys):
    # every write to /dev/full fails with "No space left on device"
    assert main([*_generate_args(model_dir, tmp_path), "--output", "/dev/full"]) == 1
    assert "cannot write '/dev/full' (No space left" in one_error_line(capsys.readouterr().err)


def test_an_unreadable_input_is_one_line_exit_1(model_dir, tmp_path, capsys, monkeypatch):
    generate = _generate_args(model_dir, tmp_path)

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    assert main(generate) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "Permission denied" in line and "p.txt" in line


def test_a_kv_cache_larger_than_memory_is_one_line_exit_1(model_dir, tmp_path, capsys):
    assert main([*_generate_args(model_dir, tmp_path), "--num-kv-blocks", "99999999999"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "out of memory" in line and "ask for less: --max-num-seqs, --num-kv-blocks" in line


def test_out_of_memory_names_only_the_command_s_own_options(monkeypatch, capsys):
    from cupy_llama.bench import offline as bench

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot allocate")

    monkeypatch.setattr(bench, "bench_command", out_of_memory)
    assert main(["bench", "latency", "--preset", "tiny", *CPU]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == ("error: out of memory (cannot allocate); ask for less: --max-num-seqs, "
                    "--gpu-memory-utilization")


def test_chat_with_an_empty_message_is_a_usage_error_before_loading(model_dir):
    """Piped or given as PROMPT, an empty message is the same mistake: exit 2, one line."""
    for args, stdin, fragment in ((["  "], None, "PROMPT is empty"),
                                  ([], "  \n", "stdin is empty"), ([], "", "stdin is empty")):
        result = cli("chat", "--model", str(model_dir), *CPU, *args, stdin=stdin)
        assert result.returncode == 2, (args, stdin, result.stderr)
        assert fragment in one_error_line(result.stderr)
        assert "loading" not in result.stderr


def test_fetch_demo_help_says_which_folders_out_takes(capsys):
    """The folders the guard lets through (demo._check_out_dir), named in --out's help, its
    marker file by the name the build writes."""
    from cupy_llama.cli.demo import BUILD_MARKER
    assert main(["fetch-demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (f"a new or empty folder, or an earlier build of the demo model (it holds a "
            f"{BUILD_MARKER} file); a folder that holds other files is refused.") in text


def test_fetch_demo_never_deletes_what_is_in_out(tmp_path, capsys, monkeypatch):
    from cupy_llama.cli import demo

    def no_download(*args, **kwargs):
        raise AssertionError("the guard let fetch-demo build")

    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "_open_gguf", no_download)
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "important.txt").write_text("precious")
    assert main(["fetch-demo", "--out", str(keep), "--no-check"]) == 1
    assert "holds other files (important.txt" in one_error_line(capsys.readouterr().err)
    monkeypatch.chdir(keep)
    assert main(["fetch-demo", "--out", ".", "--no-check"]) == 1  # "." names the same folder
    assert "holds other files" in one_error_line(capsys.readouterr().err)
    assert (keep / "important.txt").read_text() == "precious"
    # another model's folder, even one of the demo's file names alone or all of them
    for names in (("config.json", "model.safetensors"), demo.MODEL_FILES):
        other = tmp_path / f"model{len(names)}"
        other.mkdir()
        for name in names:
            (other / name).write_text("theirs")
        assert main(["fetch-demo", "--out", str(other), "--no-check", "--force"]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert "already holds another model's files (" in line and "config.json" in line
        assert all((other / name).read_text() == "theirs" for name in names)


def test_a_default_id_that_repeats_a_given_one_says_so(model_dir, tmp_path):
    code, rows = run_generate(model_dir, tmp_path, b'{"id": 2, "prompt": "a"}\n{"prompt": "b"}\n')
    assert code == 1 and "text" in rows[0]
    assert rows[1]["error"].startswith("line 2: duplicate id 2 (its line number, the default id)")
    code, rows = run_generate(model_dir, tmp_path, b'{"prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    assert rows[1]["error"].startswith("line 2: duplicate id 1, first used on line 1 (its line "
                                       "number, the default id)")


def test_bench_engine_options_are_usage_errors_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    for flag, value in (("--max-num-seqs", "0"), ("--gpu-memory-utilization", "5")):
        assert main(["bench", "latency", "--preset", "tiny", *CPU, flag, value]) == 2
        assert one_error_line(capsys.readouterr().err).startswith(f"error: {flag} must be")
    assert not (tmp_path / "cache").exists()  # no model written, nothing measured


def test_an_os_error_not_about_a_named_file_keeps_its_traceback(monkeypatch):
    import errno
    from cupy_llama import cli as cli_module

    def broken(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(cli_module.cli, "main", broken)
    with pytest.raises(OSError):
        main(["info"])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_bench_json_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "latency", "--preset", "tiny", "--scale", "0.05", *CPU,
                 "--max-num-seqs", "4", "--json", "/dev/full"]) == 1
    assert "cannot write '/dev/full' (No space left" in one_error_line(capsys.readouterr().err)


def test_fetch_demo_into_the_current_folder_keeps_the_folder(tmp_path, monkeypatch, capsys):
    """--out . builds into the folder the shell sits in: the files appear there, the folder
    itself (and what else it holds after a complete build) stays; the temp folder of a
    killed build is no obstacle. The GGUF work is stood in for."""
    from cupy_llama.cli import demo
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    builds = []
    monkeypatch.setattr(demo, "_open_gguf", lambda gguf_path, log: (None, Path("demo.gguf")))

    def small_files(reader, tmp, log):
        builds.append(tmp)
        for name in demo.MODEL_FILES:
            (tmp / name).write_text(f"built {len(builds)}")
        return {}

    monkeypatch.setattr(demo, "_write_small_files", small_files)
    monkeypatch.setattr(demo, "convert_weights", lambda reader, config: {})
    monkeypatch.setattr(demo, "write_safetensors",
                        lambda path, tensors, metadata: path.write_text(f"built {len(builds)}"))
    inode = here.stat().st_ino
    (here / ".here.k3j2").mkdir()  # left by a build that was killed
    assert main(["fetch-demo", "--out", ".", "--no-check"]) == 0
    assert sorted(p.name for p in here.iterdir() if p.name != ".here.k3j2") == \
        sorted([*demo.MODEL_FILES, demo.BUILD_MARKER])
    assert here.stat().st_ino == inode and Path.cwd() == here.resolve()
    (here / "notes.txt").write_text("mine")  # beside a complete build: allowed, and kept
    assert main(["fetch-demo", "--out", ".", "--no-check", "--force"]) == 0
    assert (here / "notes.txt").read_text() == "mine"
    assert (here / "config.json").read_text() == "built 2"
    assert len(builds) == 2 and not any(b.exists() for b in builds)  # no temp folder left
    assert capsys.readouterr().out.splitlines()[-1] == str(here.resolve())


def test_commands_say_which_options_the_cpu_ignores(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "latency", "--preset", "tiny", "--scale", "0.05", *CPU,
                 "--max-num-seqs", "4", "--enforce-eager"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --enforce-eager applies to the GPU only; ignored on the CPU") == 1
    assert main([*_generate_args(model_dir, tmp_path), "--gpu-memory-utilization", "0.5"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --gpu-memory-utilization applies to the GPU only; ignored on "
                     "the CPU") == 1


# ---- exit codes, progress and resuming ------------------------------------------------------

def test_bare_command_prints_the_help_and_exits_0(capsys):
    assert main([]) == 0
    bare = capsys.readouterr()
    assert main(["--help"]) == 0
    assert bare.out == capsys.readouterr().out and "Commands:" in bare.out
    assert bare.err == ""
    result = cli()
    assert result.returncode == 0 and result.stdout == bare.out and result.stderr == ""


def test_generate_exits_1_when_a_request_failed_and_says_how_many(model_dir, tmp_path, capsys):
    content = b'{"prompt": "fine"}\n{"prompt": "bad", "top_p": 7}\nnot json\n{"prompt": "ok"}\n'
    code, rows = run_generate(model_dir, tmp_path, content)
    err = capsys.readouterr().err
    assert code == 1 and [("error" in row) for row in rows] == [False, True, True, False]
    assert "4 requests (2 failed)" in err
    line = one_error_line(err)
    assert line.startswith("error: 2 of 4 requests failed") and "out.jsonl" in line
    code, rows = run_generate(model_dir, tmp_path, b'{"prompt": "fine"}\n')
    assert code == 0 and "error:" not in capsys.readouterr().err


def test_progress_lines_off_a_terminal(model_dir, tmp_path, capsys):
    path = tmp_path / "in.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(6)))
    assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU,
                 "--temperature", "0", "--max-tokens", "5", "--max-num-seqs", "2",
                 "--progress-interval", "0"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("progress: ")]
    pattern = re.compile(r"progress: (\d+)/6 requests done, [\d,.]+ completion tok/s, "
                         r"ETA (unknown|\d+ s|\d+ min \d\d s)$")
    done = [int(pattern.match(line).group(1)) for line in lines]
    assert done == sorted(done) and done[-1] == 6 and len(lines) >= 6
    assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU,
                 "--progress-interval", "-1"]) == 2
    assert "--progress-interval must be >= 0" in one_error_line(capsys.readouterr().err)


def test_output_that_names_the_input_is_a_usage_error(model_dir, tmp_path, capsys):
    path = tmp_path / "in.txt"
    path.write_text("keep me\n")
    (tmp_path / "link.txt").symlink_to(path)
    os.link(path, tmp_path / "hard.txt")
    for output in (path, tmp_path / "." / "in.txt", tmp_path / "sub" / ".." / "in.txt",
                   tmp_path / "link.txt", tmp_path / "hard.txt"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU,
                     "--output", str(output)]) == 2, output
        line = one_error_line(capsys.readouterr().err)
        assert "is the --input file" in line and "--output" in line
    assert path.read_text() == "keep me\n"


def resumable_input(tmp_path):
    """Five one-token requests, then twelve of 40 tokens: with --max-num-seqs 2 the long
    ones take about 240 steps."""
    rows = [{"id": f"short-{i}", "prompt": f"short {i}", "max_tokens": 1} for i in range(5)]
    rows += [{"id": f"long-{i}", "prompt": f"long prompt {i}", "max_tokens": 40}
             for i in range(12)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, rows


def full_run(llm, rows):
    return [{"id": row["id"], "text": expected(llm, row["prompt"], max_tokens=row["max_tokens"],
                                               ignore_eos=True).text} for row in rows]


def texts(path):
    return [{"id": r["id"], "text": r["text"]} for r in read_jsonl(path)]


def test_ctrl_c_stops_generate_with_a_summary_and_resume_finishes_it(model_dir, llm, tmp_path):
    path, rows = resumable_input(tmp_path)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "cupy_llama.cli", "generate", "--model", str(model_dir),
            "--input", str(path), "--output", str(out), *CPU, "--temperature", "0",
            "--ignore-eos", "--max-num-seqs", "2", "--progress-interval", "0"]
    # stderr through a pipe of one page: a progress line per step, so the child blocks
    # once it is about 50 steps ahead of what this test has read, and cannot finish before
    # the signal comes, however the machine schedules the two
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    # SIGINT as a terminal sends it, whatever the test run inherited (a background job's
    # is ignored)
    child = subprocess.Popen(args, stderr=write_end,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(write_end)
    with open(read_end, encoding="utf-8") as stderr:
        try:
            seen = []
            for line in stderr:  # wait for the state: the five short ones are done
                seen.append(line)
                if line.startswith("progress: 5/17 "):
                    break
            child.send_signal(signal.SIGINT)
            seen += stderr.readlines()
            child.wait(timeout=120)
        finally:
            child.kill()
    err = "".join(seen)
    assert child.returncode == 130, err
    written = texts(out)  # every line whole
    whole = full_run(llm, rows)
    assert 5 <= len(written) < 17 and written == whole[:len(written)]
    assert re.search(rf"interrupted: {len(written)} of 17 results are in '{out}'; the same "
                     rf"command with --resume runs the other {17 - len(written)}", err), err
    assert f"{len(written)} of 17 requests done" in err and "Traceback" not in err
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {len(written)} of 17 requests are already in" in resumed.stderr
    assert texts(out) == whole  # as one uninterrupted run writes it


def test_resume_runs_a_cut_last_line_again_and_checks_the_file(model_dir, llm, tmp_path,
                                                              capsys):
    path = tmp_path / "in.txt"
    prompts = ["one", "", "three", "four", "five"]  # ids are line numbers: 1, 3, 4, 5
    path.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(path), "--output", str(out),
            *CPU, "--temperature", "0", "--max-tokens", "4"]
    assert main(args) == 0
    whole = out.read_text()
    lines = whole.splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:len(lines[1]) // 2])   # killed while writing id 3
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "resuming: 1 of 4 requests are already in" in err and "cut short" in err
    assert out.read_text() == whole
    out.write_text(lines[0] + lines[1].rstrip("\n"))   # whole, but no line end
    assert main(args + ["--resume"]) == 0
    assert out.read_text() == whole
    assert main(args + ["--resume"]) == 0   # nothing left to do
    assert "nothing to do: all 4 requests are already in" in capsys.readouterr().err
    assert out.read_text() == whole
    out.write_text(lines[0] + '{"id": 99, "text": "x"}\n')
    assert main(args + ["--resume"]) == 1
    assert "holds id 99, which the input does not have" in one_error_line(
        capsys.readouterr().err)
    out.write_text("not a result\n" + lines[0])
    assert main(args + ["--resume"]) == 1
    assert "line 1 is not a result line" in one_error_line(capsys.readouterr().err)
    assert main(args[:5] + args[7:] + ["--resume"]) == 2   # stdout: nothing to resume from
    assert "--resume needs --output FILE" in one_error_line(capsys.readouterr().err)


def test_resume_before_any_output_runs_everything(model_dir, tmp_path, capsys):
    """A run stopped before it wrote its output (Ctrl-C while the model loaded) leaves no
    file: the same command with --resume runs every request, and keeps its options for
    the next --resume, as a run without it does."""
    path = tmp_path / "in.txt"
    path.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(path), "--output", str(out),
            *CPU, "--temperature", "0", "--max-tokens", "3"]
    assert main(args + ["--resume"]) == 0
    assert f"resuming: {str(out)!r} does not exist yet; running all 2 requests" in \
        capsys.readouterr().err
    assert [row["id"] for row in read_jsonl(out)] == [1, 2]
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    assert main(args[:-1] + ["4", "--resume"]) == 2
    assert "--max-tokens 4 (the first run: --max-tokens 3)" in one_error_line(
        capsys.readouterr().err)


def test_resume_counts_the_failures_an_earlier_run_wrote(model_dir, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "top_p": 9}\n{"id": "b", "prompt": "y"}\n')
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(path), "--output", str(out),
            *CPU, "--temperature", "0", "--max-tokens", "2"]
    assert main(args) == 1
    capsys.readouterr()
    first = out.read_text().splitlines()
    out.write_text(first[0] + "\n")   # the failed line is there, the good one is not
    assert main(args + ["--resume"]) == 1
    assert one_error_line(capsys.readouterr().err).startswith("error: 1 of 2 requests failed")
    assert out.read_text().splitlines() == first


class Screen:
    """The few terminal controls rich's live display uses, enough to see which characters
    end up on one screen line: carriage return, line feed, erase line, cursor up, and
    styles and cursor visibility (ignored)."""
    CONTROL = re.compile(r"\x1b\[(\??)(\d*)([A-Za-z])")

    def __init__(self, text: str):
        self.lines, row, col = [[]], 0, 0
        at = 0
        while at < len(text):
            control = self.CONTROL.match(text, at)
            if control:
                at = control.end()
                private, number, code = control.groups()
                if code == "K" and not private:
                    self.lines[row] = []
                elif code == "A" and not private:
                    row = max(0, row - int(number or 1))
                continue
            char = text[at]
            at += 1
            if char == "\r":
                col = 0
            elif char == "\n":
                row += 1
                if row == len(self.lines):
                    self.lines.append([])
            else:
                line = self.lines[row]
                line.extend(" " * (col - len(line)))
                line[col:col + 1] = [char]
                col += 1

    def text_lines(self) -> list[str]:
        return ["".join(line).rstrip() for line in self.lines]


def test_the_progress_bar_never_shares_a_line_with_the_results(model_dir, llm, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    path = tmp_path / "in.txt"
    path.write_text("".join(f"prompt number {i}\n" for i in range(8)))
    child = pexpect.spawn(sys.executable, ["-m", "cupy_llama.cli", "generate", "--model",
                                           str(model_dir), "--input", str(path), "--raw",
                                           *CPU, "--temperature", "0", "--max-tokens", "40",
                                           "--ignore-eos", "--max-num-seqs", "2"],
                          encoding="utf-8", timeout=120, dimensions=(40, 200),
                          env={**os.environ, "TERM": "xterm-256color"})
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    screen = Screen(child.before).text_lines()
    results = [line for line in screen if '{"id"' in line]
    assert [json.loads(line)["text"] for line in results] == [
        expected(llm, f"prompt number {i}", max_tokens=40, ignore_eos=True).text
        for i in range(8)]
    assert any("generating" in line for line in screen)  # the bar was there


def test_a_result_line_above_the_bar_stays_one_line():
    """A text holding U+2028 or U+0085 is still one JSON line on the terminal."""
    from cupy_llama.cli.generate import _ConsoleLines

    class Console:
        printed = []

        def print(self, line, **_):
            self.printed.append(line)

    lines = _ConsoleLines(Console())
    row = json.dumps({"id": 0, "text": "a\u2028b\x85c\x1ed"}, ensure_ascii=False)
    lines.write(row + "\n")
    lines.write("")
    assert Console.printed == [row] and json.loads(Console.printed[0])["text"] == "a\u2028b\x85c\x1ed"

def test_generate_and_info_default_to_the_demo_model(model_dir, llm, tmp_path, monkeypatch,
                                                     capsys):
    """Without --model both run the demo model, as chat and serve do; an OpenAI batch
    line's body names it as serve does."""
    from cupy_llama.cli import options
    from cupy_llama.cli.demo import DEMO_NAME
    monkeypatch.setattr(options, "default_model_dir", lambda: Path(model_dir))
    assert main(["info", *CPU, "--num-kv-blocks", "10"]) == 0
    assert "10 blocks x 16 tokens" in capsys.readouterr().out
    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"model": DEMO_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0}}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--input", str(path), "--output", str(out), *CPU]) == 0
    row = json.loads(out.read_text())
    assert row["response"]["status_code"] == 200
    assert row["response"]["body"]["model"] == DEMO_NAME
    assert row["response"]["body"]["choices"][0]["text"] == expected(llm, "hello", max_tokens=3).text


def test_an_output_with_results_is_kept_unless_resume_or_overwrite(model_dir, tmp_path, capsys):
    """A finished output is never replaced without a word: a run to an --output that holds
    results is refused (exit 2, before the model loads) unless --resume finishes it or
    --overwrite replaces it."""
    path = tmp_path / "in.txt"
    path.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(path), "--output", str(out),
            *CPU, "--temperature", "0", "--max-tokens", "3"]
    assert main(args) == 0
    first = out.read_text()
    capsys.readouterr()
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "already holds results" in line and "--resume" in line and "--overwrite" in line
    assert out.read_text() == first
    assert main(args + ["--overwrite", "--max-tokens", "2"]) == 0
    assert out.read_text() != first and len(out.read_text().splitlines()) == 2
    assert main(args + ["--resume", "--overwrite"]) == 2
    out.write_text("")  # an empty file holds nothing to keep
    assert main(args) == 0


def test_resume_refuses_other_options_and_loads_nothing_when_done(model_dir, tmp_path, capsys,
                                                                    monkeypatch):
    """The options that shape the results are kept beside the output: a --resume that gives
    other ones is refused naming each (exit 2); a --resume with nothing left says so
    without loading the model."""
    path = tmp_path / "in.txt"
    path.write_text("one\ntwo\nthree\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(path), "--output", str(out),
            *CPU, "--temperature", "0", "--max-tokens", "3"]
    assert main(args) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0])
    capsys.readouterr()
    assert main(args[:-1] + ["5", "--raw", "--resume"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--max-tokens 5 (the first run: --max-tokens 3)" in line
    assert "--raw (the first run: no --raw)" in line and "--overwrite" in line
    assert out.read_text() == lines[0]
    assert main(args + ["--resume"]) == 0
    assert out.read_text() == "".join(lines)
    capsys.readouterr()

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("cupy_llama.cli.options.load", no_loading)
    assert main(args + ["--resume"]) == 0
    assert "nothing to do: all 3 requests are already in" in capsys.readouterr().err


def test_an_interrupted_summary_counts_the_finished_requests_only(llm):
    """Ctrl-C's summary counts prompt and completion tokens of the same requests, those that
    finished: not the prompts of the finished ones beside the tokens of running ones."""
    import io
    from cupy_llama.cli.batch_io import BatchRequest, run_batch
    requests = [BatchRequest(i + 1, i + 1, prompt=[10 + i] * 6,
                             sampling={"max_tokens": 2 if i % 2 else 60, "ignore_eos": True,
                                       "temperature": 0})
                for i in range(6)]
    calls = 0

    def interrupt_later(num_done, generated):
        nonlocal calls
        calls += 1
        if calls == 6:  # the 2-token requests are done, the 60-token ones run
            raise KeyboardInterrupt

    summary = run_batch(llm, requests, io.StringIO(), {}, progress=interrupt_later)
    assert summary.interrupted
    assert (summary.prompt_tokens, summary.completion_tokens) == (3 * 6, 3 * 2)


def test_the_cpu_warning_is_one_short_line_that_device_cpu_silences(model_dir, tmp_path,
                                                                    capsys):
    """Every command on a machine without a usable GPU (chat, and info, which plans for
    it) warns in one short line that says why; --device cpu (which asks for the CPU) has
    none."""
    from cupy_llama.backends.cuda import cuda_usable
    if cuda_usable()[0]:
        pytest.skip("a usable GPU is present: auto means the GPU there")
    for args in (["chat", "--model", str(model_dir), "--max-tokens", "1", "Hi"],
                 ["info", "--model", str(model_dir)]):
        assert main(args) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and len(warnings[0]) <= 100, warnings
        assert "running on the CPU" in warnings[0] and "--device cpu" in warnings[0]
        assert main(args + ["--device", "cpu"]) == 0
        assert "warning" not in capsys.readouterr().err


def test_generate_expands_a_quoted_tilde_in_its_output(model_dir, tmp_path, monkeypatch, capsys):
    """An --output "~/..." that no shell expanded (quoted, or from a script) names the
    home folder, for the results and the run's options alike, as its checks took it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "in.txt").write_text("hi\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"), *CPU,
                 "--max-tokens", "2", "--output", "~/out.jsonl"]) == 0
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [row["id"] for row in rows] == [1] and "text" in rows[0]
    assert (tmp_path / "out.jsonl.run.json").is_file()


def test_generate_writes_to_an_output_that_is_no_file(model_dir, tmp_path, monkeypatch, capsys):
    """--output /dev/null runs (no options file beside a device), and an output whose folder
    takes no options file runs with a warning instead of failing after the model loaded."""
    from cupy_llama.cli import generate as generate_command
    (tmp_path / "in.txt").write_text("hi\n")
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"), *CPU,
            "--max-tokens", "2"]
    asked = []

    def spy(output):  # where the options would go: never into /dev, whatever the code does
        asked.append(output)
        return tmp_path / "kept.run.json"
    monkeypatch.setattr(generate_command, "_options_path", spy)
    assert main(args + ["--output", "/dev/null"]) == 0
    assert asked == []  # no options file beside a device
    monkeypatch.setattr(generate_command, "_options_path",
                        lambda output: tmp_path / "no such folder" / "x.run.json")
    assert main(args + ["--output", str(tmp_path / "out.jsonl")]) == 0
    assert [row["id"] for row in read_jsonl(tmp_path / "out.jsonl")] == [1]
    err = capsys.readouterr().err
    assert "warning: cannot keep this run's options in" in err and "will not check them" in err


def test_a_missing_choice_argument_is_one_readable_line(capsys):
    """click spreads the choices over indented lines; the one line keeps them a list."""
    assert main(["bench"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: Missing argument 'MODE'. Choose from: throughput, latency, ")
    assert "\t" not in line and ",;" not in line and ":;" not in line

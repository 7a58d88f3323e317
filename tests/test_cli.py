"""`cupy-llama generate` and `info` on a tiny random model, and the exit codes."""
import json
import subprocess
import sys

from cupy_llama import SamplingParams
from cupy_llama.cli import main
from cupy_llama.random_model import make_random_model

CPU = ["--device", "cpu"]


def run_generate(model_dir, tmp_path, content: bytes, name="in.jsonl", *extra):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
                 str(out), *CPU, "--temperature", "0", "--max-tokens", "6", *extra])
    lines = out.read_text(encoding="utf-8").splitlines()
    return code, [json.loads(line) for line in lines]


def expected(llm, prompt, **params):
    values = dict(temperature=0, max_tokens=6)
    values.update(params)
    return llm.generate(prompt, SamplingParams(**values))


def test_txt_with_crlf_bom_and_blank_lines(model_dir, llm, tmp_path):
    content = "\ufeffhello there\r\n\r\n  \r\nsecond prompt\r\nthird\n".encode()
    code, rows = run_generate(model_dir, tmp_path, content, "in.txt")
    assert code == 0
    assert [r["id"] for r in rows] == [1, 4, 5]   # line numbers; blank lines skipped
    for row, prompt in zip(rows, ["hello there", "second prompt", "third"]):
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
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": chat, "max_tokens": 2}},
        {"id": "a", "prompt": "reused id"},                            # duplicate
        {"id": "d", "prompt": "x", "colour": "red"},                   # unknown field
        {"id": "e"},                                                   # no prompt
        ["a", "list"],
        {"id": "f", "prompt": "x" * 5000},                             # longer than the context
        {"id": 7, "prompt": "numeric id", "stop": ["zz"]},
    ]
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    code, rows = run_generate(model_dir, tmp_path, text.encode())
    assert code == 0
    assert [r["id"] for r in rows] == ["a", 2, 3, "b", "c", "a", "d", "e", 9, "f", 7]
    ok = {i for i, r in enumerate(rows) if "error" not in r}
    assert ok == {0, 3, 4, 10}
    assert rows[0]["text"] == expected(llm, "first", max_tokens=3).text
    assert rows[3]["text"] == llm.chat(chat, SamplingParams(temperature=0, max_tokens=6)).text
    assert rows[4]["usage"]["completion_tokens"] == 2
    assert rows[10]["text"] == expected(llm, "numeric id", stop=["zz"]).text
    assert "-1" in rows[1]["error"] and "temperature" in rows[1]["error"]
    assert "not valid JSON" in rows[2]["error"]
    assert "duplicate id 'a'" in rows[5]["error"] and "line 1" in rows[5]["error"]
    assert "colour" in rows[6]["error"]
    assert "prompt" in rows[7]["error"]
    assert "JSON object" in rows[8]["error"]
    assert "context limit" in rows[9]["error"]
    assert all(set(r) == {"id", "error"} for i, r in enumerate(rows) if i not in ok)


def test_empty_file_gives_empty_output(model_dir, tmp_path):
    for content in (b"", b"\xef\xbb\xbf", b"\r\n\n  \n"):
        code, rows = run_generate(model_dir, tmp_path, content)
        assert code == 0 and rows == []


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
    from pathlib import Path
    from cupy_llama.batch_io import read_requests
    examples = Path(__file__).parent.parent / "examples"
    for name, fmt in (("prompts.txt", "txt"), ("requests.jsonl", "jsonl")):
        requests = read_requests((examples / name).read_bytes(), fmt)
        assert requests and all(r.error is None for r in requests), name


def test_info(model_dir, capsys):
    assert main(["info", "--model", str(model_dir), *CPU, "--num-kv-blocks", "10"]) == 0
    out = capsys.readouterr().out
    from cupy_llama.config import ModelConfig
    config = ModelConfig.from_dir(model_dir)
    assert f"{config.num_parameters:,}" in out
    assert "10 blocks x 16 tokens = 160 tokens" in out
    assert "hidden 64, 2 layers, 4 heads (2 KV)" in out


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "cupy_llama.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_missing_model_dir_is_one_line_exit_1(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    result = cli("generate", "--model", str(tmp_path / "nope"), "--input", str(prompts), *CPU)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "does not exist" in error_lines[0]


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


def test_unknown_input_format_is_exit_1(model_dir, tmp_path, capsys):
    path = tmp_path / "prompts.csv"
    path.write_text("hi\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(path), *CPU]) == 1
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
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "text" in lines[0]
    assert "not valid Unicode" in lines[1]["error"]
    assert "top_k" in lines[2]["error"] and "top_p" in lines[3]["error"]

    bad = subprocess.run(run + [str(jsonl), "--top-k", "3000000000"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: top_k")
    assert "loading" not in bad.stderr  # refused before the model was read

    many = tmp_path / "many.txt"
    many.write_text("".join(f"prompt {i}\n" for i in range(40)))
    piped = subprocess.run(" ".join(run + [str(many)]) + " 2>/dev/null | head -1; "
                           "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                           capture_output=True, text=True)
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 1

"""OpenAI batch files through `cupy-llama generate`: each line's response body equals what
a real `cupy-llama serve` (one per module, the same tiny model on the NumPy backend)
answers for the same request; refusals carry the server's status and message; the file's
shape is checked before the model loads; --resume reads custom_ids."""
import pytest

pytest.importorskip("fastapi")  # the server half of the comparison (the test extra)

import io
import json
import re
import sys

import httpx

from conftest import one_error_line, read_jsonl
from test_server import ServerProcess

from cupy_llama.cli.batch_io import read_requests, run_batch
from cupy_llama.cli import main

# Prefix caching off on both sides: the server answers one request at a time while a batch
# runs all at once, so cache hits (usage.prompt_tokens_details.cached_tokens) would differ.
ENGINE = ["--device", "cpu", "--no-prefix-caching"]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BATCH_ID = re.compile(r"^batch_req_[0-9a-f]{32}$")
REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
HARMLESS = {"n": 1, "stream": False, "frequency_penalty": 0, "presence_penalty": 0,
            "response_format": {"type": "text"}, "user": "someone",
            "colour": "not a field of the API"}


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess(model_dir, "--no-prefix-caching")
    try:
        yield process
    finally:
        process.stop()


def batch_line(custom_id, body, url=CHAT, method="POST", **extra) -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body, **extra}


def write_lines(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def generate(model_dir, tmp_path, lines, *options, out=None) -> tuple[int, list[dict]]:
    path = tmp_path / "batch.jsonl"
    write_lines(path, lines)
    out = out or tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
                 str(out), *ENGINE, *options])
    return code, read_jsonl(out)


def served(server, line) -> httpx.Response:
    return httpx.request(line["method"], server.url + line["url"], json=line["body"],
                         timeout=60)


def assert_close(got, want, where="body"):
    """Equal, up to 1e-4 in each number that is not an integer (log-probabilities)."""
    if isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def without_ids(body: dict) -> dict:
    """A response body without what differs by nature between two answers."""
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def assert_same_as_served(server, line: dict, row: dict) -> None:
    """row: the batch output line of `line`; the server is asked the same request."""
    answer = served(server, line)
    response = row["response"]
    assert row["custom_id"] == line["custom_id"]
    assert BATCH_ID.match(row["id"]) and REQUEST_ID.match(response["request_id"])
    assert response["status_code"] == answer.status_code, (line, answer.text)
    if answer.status_code == 200:
        body = response["body"]
        assert row["error"] is None
        prefix = "chatcmpl-" if line["url"] == CHAT else "cmpl-"
        assert body["id"].startswith(prefix) and body["id"] != answer.json()["id"]
        assert isinstance(body["created"], int)
        assert_close(without_ids(body), without_ids(answer.json()))
    else:
        error = response["body"]["error"]
        assert row["error"] == {"code": error["code"] or error["type"],
                                "message": error["message"]}


def test_an_openai_batch_file_answers_as_serve_does(model_dir, server, tmp_path, capsys):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                 {"type": "text", "text": "there"}]}]
    harmless = {**HARMLESS, "model": model_dir.name}  # the server's name for it
    lines = [
        batch_line("chat-harmless", {"messages": conversation, "max_tokens": 6,
                                     "temperature": 0, "logprobs": False, **harmless},
                   metadata={"team": "tests"}),
        batch_line("completion", {"prompt": "Once upon a time", "max_tokens": 5,
                                  "temperature": 0, "echo": False, **harmless},
                   url=COMPLETIONS),
        batch_line("embeddings", {"input": "Hello"}, url="/v1/embeddings"),
        batch_line("get", {"messages": conversation}, method="GET"),
        batch_line("chat-logprobs", {"messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 4, "temperature": 0,
                                     "logprobs": True, "top_logprobs": 2}),
        batch_line("completion-n", {"prompt": ["abc", "Hello there"], "max_tokens": 4,
                                    "temperature": 1.0, "seed": 3, "n": 3, "logprobs": 1},
                   url=COMPLETIONS),
        batch_line("chat-n", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "temperature": 1.0, "seed": 7, "n": 2}),
        batch_line("tools", {"messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}),
        batch_line("chat-json", {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 200, "temperature": 0,
                                 "response_format": {"type": "json_schema", "json_schema": {
                                     "name": "n", "schema": {"enum": [1, "two", None]}}}}),
        batch_line("completion-choice", {"prompt": "Pick:", "max_tokens": 20, "temperature": 1,
                                         "seed": 2, "guided_choice": ["up", "down"]},
                   url=COMPLETIONS),
    ]
    code, rows = generate(model_dir, tmp_path, lines, "--progress-interval", "0")
    err = capsys.readouterr().err
    assert code == 1  # some lines failed
    assert [row["custom_id"] for row in rows] == [line["custom_id"] for line in lines]
    for line, row in zip(lines, rows):
        assert set(row) == {"id", "custom_id", "response", "error"}
        assert_same_as_served(server, line, row)
    assert len({row["id"] for row in rows}) == len(rows)
    statuses = [row["response"]["status_code"] for row in rows]
    assert statuses == [200, 200, 404, 405, 200, 200, 200, 400, 200, 200]
    assert [len(row["response"]["body"]["choices"]) for row in rows if row["error"] is None] \
        == [1, 1, 1, 6, 2, 1, 1]
    # constrained lines follow their constraints
    assert json.loads(rows[8]["response"]["body"]["choices"][0]["message"]["content"]) in (1, "two", None)
    assert rows[9]["response"]["body"]["choices"][0]["text"] in ("up", "down")
    # the bad lines say what is supported
    assert rows[2]["error"]["message"] == ('url "/v1/embeddings" is not supported; batch '
                                           'lines go to /v1/chat/completions or '
                                           '/v1/completions')
    assert rows[3]["error"]["code"] == "unsupported_method" and \
        "batch lines are POST requests" in rows[3]["error"]["message"]
    # the built-in Llama 3 format refuses tools: the line hears that, not a parser's name
    assert "chat format does not support tools" in rows[7]["error"]["message"]
    assert "10 requests (3 failed)" in err and "progress: 10/10 requests done" in err
    assert one_error_line(err).startswith("error: 3 of 10 requests failed")


def test_refused_bodies_get_the_server_s_status_and_message(model_dir, server, tmp_path):
    hi = [{"role": "user", "content": "hi"}]
    bodies = [
        (CHAT, {"messages": hi, "presence_penalty": 5}),
        (CHAT, {"messages": hi, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x"}}}),
        (CHAT, {"messages": hi, "structured_outputs": {"grammar": "start: nowhere"}}),
        (CHAT, {"messages": hi, "max_tokens": "5"}),
        (CHAT, {"messages": [{"role": "function", "content": "x"}]}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (CHAT, {"messages": hi, "stream_options": {"include_usage": True}}),
        (CHAT, {"messages": hi, "top_logprobs": 2}),
        (CHAT, {"messages": hi, "max_tokens": 100000}),
        (CHAT, {"prompt": "no messages"}),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 500}}),
        (COMPLETIONS, {"prompt": "x", "logprobs": False}),
        (COMPLETIONS, {"prompt": [], "max_tokens": 2}),
        (COMPLETIONS, {"prompt": [99999], "max_tokens": 2}),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}),
        (COMPLETIONS, {"prompt": "x", "n": 0}),
        (COMPLETIONS, ["not", "an", "object"]),
    ]
    lines = [batch_line(f"r{i}", body, url=url) for i, (url, body) in enumerate(bodies)]
    code, rows = generate(model_dir, tmp_path, lines)
    assert code == 1 and len(rows) == len(lines)
    for line, row in zip(lines, rows):
        assert row["response"]["status_code"] == 400, line
        assert row["error"] is not None, line
        assert_same_as_served(server, line, row)
        # the whole error body as the server's, its param too
        assert row["response"]["body"]["error"] == served(server, line).json()["error"], line


def test_stream_and_missing_fields_are_refused_with_what_to_do(model_dir, tmp_path):
    hi = [{"role": "user", "content": "hi"}]
    lines = [batch_line("stream", {"messages": hi, "stream": True}),
             {"custom_id": "no-url", "method": "POST", "body": {"messages": hi}},
             {"custom_id": "no-method", "url": CHAT, "body": {"messages": hi}},
             {"custom_id": "no-body", "method": "POST", "url": COMPLETIONS}]
    code, rows = generate(model_dir, tmp_path, lines)
    assert code == 1
    assert [(r["response"]["status_code"], r["error"]["message"]) for r in rows] == [
        (400, "stream: true is not supported in a batch file (each line is answered with "
              "one response body); remove stream"),
        (400, "url is required: /v1/chat/completions or /v1/completions"),
        (400, "method is required: POST"),
        (400, "body is required: the request to /v1/completions")]
    assert [r["response"]["body"]["error"]["param"] for r in rows] == [
        "stream", "url", "method", "body"]


def test_command_line_sampling_options_fill_in_what_a_body_leaves_out(model_dir, server,
                                                                      tmp_path):
    lines = [batch_line("left-out", {"prompt": "Once upon a time"}, url=COMPLETIONS),
             batch_line("given", {"prompt": "Once upon a time", "max_tokens": 2,
                                  "temperature": 0}, url=COMPLETIONS),
             batch_line("chat", {"messages": [{"role": "user", "content": "hi"}],
                                 "max_completion_tokens": 1, "model": "gpt-4o-mini"})]
    code, rows = generate(model_dir, tmp_path, lines, "--max-tokens", "3", "--temperature",
                          "0", "--stop", "never seen")
    assert code == 0
    tokens = [row["response"]["body"]["usage"]["completion_tokens"] for row in rows]
    assert tokens == [3, 2, 1]
    # the body's model is not checked (the run has the one model of --model), and the
    # answer names the model that ran, as the server names it
    assert {row["response"]["body"]["model"] for row in rows} == {model_dir.name}
    # as if the body had them: the server's answer to the filled-in body
    filled = dict(lines[0], body={"prompt": "Once upon a time", "max_tokens": 3,
                                  "temperature": 0, "stop": ["never seen"]})
    assert_same_as_served(server, filled, rows[0])


def test_resume_skips_the_custom_ids_already_written(model_dir, tmp_path, capsys):
    lines = [batch_line(f"line-{i}", {"prompt": f"prompt {i}", "max_tokens": 3,
                                      "temperature": 0}, url=COMPLETIONS) for i in range(4)]
    lines.insert(1, batch_line("bad", {"prompt": "x"}, url="/v1/embeddings"))
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, tmp_path, lines, out=out)[0] == 1
    whole = out.read_text().splitlines(keepends=True)
    out.write_text("".join(whole[:3]) + whole[3][:40])  # stopped while writing line-2's
    capsys.readouterr()
    code, rows = generate(model_dir, tmp_path, lines, "--resume", out=out)
    err = capsys.readouterr().err
    assert code == 1  # the earlier run's failed line still counts
    assert "resuming: 3 of 5 requests are already in" in err and "cut short" in err
    assert "2 requests (0 failed)" in err
    assert one_error_line(err).startswith("error: 1 of 5 requests failed")
    assert out.read_text().startswith("".join(whole[:3]))  # kept as it was
    assert [row["custom_id"] for row in rows] == [line["custom_id"] for line in lines]
    again = [json.loads(line) for line in whole]
    assert [without_ids(r["response"]["body"]) for r in rows if r["error"] is None] == \
        [without_ids(r["response"]["body"]) for r in again if r["error"] is None]
    # a plain run's output, or another file's custom_ids, are not this input's
    out.write_text('{"id": 1, "text": "x"}\n')
    assert generate(model_dir, tmp_path, lines, "--resume", out=out)[0] == 1
    assert "holds plain result lines and the input has OpenAI batch lines" in one_error_line(
        capsys.readouterr().err)
    out.write_text(whole[0].replace('"line-0"', '"elsewhere"'))
    assert generate(model_dir, tmp_path, lines, "--resume", out=out)[0] == 1
    assert "holds id 'elsewhere', which the input does not have" in one_error_line(
        capsys.readouterr().err)


@pytest.mark.parametrize("content, words", [
    ('{"prompt": "plain"}\n{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
     '"body": {"prompt": "x"}}\n',
     "line 1 is a plain request (it has none of custom_id, method, url, body), in a file of "
     "OpenAI batch requests (line 2 is one)"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\nnot json\n',
     "line 2 is not valid JSON"),
    ('{"custom_id": "a", "url": "/v1/completions"}\n{"url": "/v1/completions"}\n',
     "line 2 has no custom_id"),
    ('{"custom_id": 7, "url": "/v1/completions"}\n', "line 1: custom_id must be a string, got 7"),
    ('{"custom_id": "a", "url": "/v1/completions"}\n\n{"custom_id": "a", "body": {}}\n',
     "line 3 repeats the custom_id 'a' of line 1"),
])
def test_a_file_that_is_not_all_batch_requests_is_refused_before_loading(
        model_dir, tmp_path, capsys, content, words):
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(content)
    assert main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
                 str(out), *ENGINE]) == 2  # a usage error, as an empty file is
    err = capsys.readouterr().err
    assert words in one_error_line(err) and "loading" not in err
    assert not out.exists()


def test_without_pydantic_batch_lines_are_one_error_line(model_dir, tmp_path, capsys,
                                                         monkeypatch):
    # a source tree run without installing: the protocol module cannot be imported
    monkeypatch.setitem(sys.modules, "pydantic", None)
    monkeypatch.delitem(sys.modules, "cupy_llama.server.protocol")
    path = tmp_path / "in.jsonl"
    write_lines(path, [batch_line("a", {"prompt": "x"}, url=COMPLETIONS)])
    assert main(["generate", "--model", str(model_dir), "--input", str(path), *ENGINE]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == ("error: OpenAI batch lines need pydantic (pydantic is not installed): "
                    "pip install 'pydantic>=2.5'")


def test_an_interrupted_run_keeps_whole_lines_and_leaves_no_request_behind(llm):
    # two short lines, then three long ones, each of two prompts x two samples
    lines = [batch_line(f"line-{i}", {"prompt": ["abc", "Hello there"], "n": 2,
                                      "max_tokens": 1 if i < 2 else 30, "temperature": 0,
                                      "ignore_eos": True}, url=COMPLETIONS)
             for i in range(5)]
    requests = read_requests("".join(json.dumps(line) + "\n" for line in lines).encode(),
                             "jsonl")
    out = io.StringIO()

    def progress(num_done, completion_tokens):  # Ctrl-C once the short ones are done
        if num_done >= 2:
            raise KeyboardInterrupt

    summary = run_batch(llm, requests, out, {}, progress=progress)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert summary.interrupted and summary.num_written == 2 and summary.num_errors == 0
    assert [row["custom_id"] for row in rows] == ["line-0", "line-1"]
    assert all(len(row["response"]["body"]["choices"]) == 4 for row in rows)
    assert not llm.engine.has_unfinished_requests()  # the long ones' samples were aborted
    assert summary.prompt_tokens == 2 * sum(len(llm.tokenizer.encode(p))
                                            for p in ("abc", "Hello there"))


def test_a_server_without_a_name_serves_the_folder_name_never_the_path(server, model_dir):
    """With no --served-model-name the model's name in the API and in /metrics' model_name
    label is its folder's name: the filesystem path is never shown to clients."""
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == model_dir.name
    metrics = httpx.get(server.url + "/metrics").text
    assert set(re.findall(r'model_name="([^"]*)"', metrics)) == {model_dir.name}
    assert str(model_dir) not in metrics

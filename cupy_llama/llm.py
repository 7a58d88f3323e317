"""The public Python API: LLM(model_dir).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import os
import sys
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from .engine.llm_engine import CLOSED, EngineStats, LLMEngine
from .errors import ConfigError, RequestError
from .outputs import RequestOutput, are_token_ids, is_token_id
from .reasoning import (ReasoningParser, ReasoningSplitter, reasoning_format, split_reasoning,
                        thinking_markers)
from .sampling import SamplingParams, model_sampling_defaults
from .tokenizer import Tokenizer


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class LLM:
    """A model loaded on one device, ready to generate.

    >>> llm = LLM("path/to/model", device="cpu")
    >>> llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8)).text
    """

    def __init__(self, model_dir=None, device: str = "auto", *, model=None, log=_stderr,
                 reasoning_parser: str | None = None, **engine_options):
        """device: "auto" (the GPU when usable), "cuda" or "cpu"; model: the folder, by
        vLLM's keyword (LLM(model=...)), in place of model_dir; engine_options: the fields
        of EngineConfig (max_num_seqs, max_model_len, ...); log: where load messages go
        (None: nowhere). reasoning_parser: "qwen3" or "deepseek_r1" (vLLM's engine
        option and serve's flag): chat() then takes a reply to start thinking as serve
        does (docs/ARCHITECTURE.md, "Reasoning models"), and a constraint (tool_choice's
        grammar, or params.structured) starts after its </think>."""
        if model is not None:
            if model_dir is not None:
                raise ConfigError("give the model folder once: model_dir or model, not both")
            model_dir = model
        if model_dir is None:
            raise ConfigError("LLM needs a model folder: LLM('path/to/model') or "
                              "LLM(model='path/to/model')")
        if not isinstance(model_dir, (str, os.PathLike)):
            raise ConfigError(f"model_dir must be the path of a model folder, got "
                              f"{type(model_dir).__name__}")
        if reasoning_parser is not None:  # a wrong name, before the load
            if not isinstance(reasoning_parser, str):
                raise ConfigError(f"reasoning_parser must be a parser's name such as 'qwen3', "
                                  f"got {type(reasoning_parser).__name__}")
            try:
                reasoning_format(reasoning_parser, "reasoning_parser")
            except RequestError as e:
                raise ConfigError(str(e)) from None
        self.model_dir = Path(model_dir).expanduser()
        self.engine: LLMEngine | None = LLMEngine.load(self.model_dir, device, log=log,
                                                       **engine_options)
        engine = self.engine
        self.config, self.tokenizer, self.device = engine.config, engine.tokenizer, engine.device
        self.engine_config, self.load_seconds = engine.engine_config, engine.load_seconds
        self.max_model_len = engine.max_model_len  # the configured context limit
        # <think> and </think> where the model may think: tool calls are its answer's
        self._thinking = thinking_markers(self.tokenizer)
        self.reasoning: ReasoningParser | None = None  # reasoning_parser bound to the model
        if reasoning_parser is not None:
            try:
                self.reasoning = ReasoningParser.for_tokenizer(
                    reasoning_parser, self.tokenizer, "reasoning_parser")
            except RequestError as e:
                self.close()
                raise ConfigError(str(e)) from None
            self._thinking = self.reasoning

    @property
    def backend(self):
        return self._live_engine().backend

    @property
    def context_limit(self) -> int:
        """The longest sequence (prompt and output) the engine runs: max_model_len, or less
        when the KV cache cannot hold that many tokens."""
        return self._live_engine().context_limit

    def stats(self) -> EngineStats:
        return self._live_engine().stats()

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Hand the device memory back (weights, KV cache, buffers); the LLM cannot generate
        afterwards. `with LLM(...) as llm:` closes at the end of the block. A dropped LLM
        that was never closed gives its GPU memory back when the next one is made."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    @property
    def closed(self) -> bool:
        return self.engine is None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RequestError(CLOSED)
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (`LLM.tokenizer`), by vLLM's name for it."""
        return self.tokenizer

    # ---- generation -----------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults."""
        return SamplingParams(**model_sampling_defaults(self.config.generation_config))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 *, stream: bool = False, sampling_params=None, use_tqdm=True):
        """prompts: a string, a list of token ids, or a list of either (also as vLLM's
        {"prompt": text} and {"prompt_token_ids": ids} dicts). Returns one
        RequestOutput per prompt in order (a single one for a single prompt); with
        SamplingParams(n=k), k per prompt, as one flat list ordered by prompt and then by
        sample (RequestOutput.index), a list of k for a single prompt. With stream=True,
        an iterator of RequestOutputs carrying text deltas, each with its request_id and
        index. sampling_params: params by vLLM's name for it; use_tqdm (vLLM's progress
        bar) is taken and shows nothing."""
        params = _vllm_params(params, sampling_params)
        single, prompts = _as_prompt_list(prompts)
        param_list = self._param_list(params, len(prompts))
        engine = self._live_engine()
        if stream:
            return engine.stream(prompts, param_list)
        outputs = engine.generate(prompts, param_list)
        return outputs[0] if single and param_list[0].n == 1 else outputs

    def stream(self, prompts, params=None, *, sampling_params=None) -> Iterator[RequestOutput]:
        return self.generate(prompts, _vllm_params(params, sampling_params), stream=True)

    def chat(self, messages, params: SamplingParams | None = None, *, stream: bool = False,
             sampling_params=None, use_tqdm=True,
             date_string: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list | None = None, tool_choice=None, parallel_tool_calls: bool = True,
             tool_call_parser: str | None = None, chat_template: str | None = None,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False):
        """messages: [{"role": ..., "content": ...}, ...], answered with one RequestOutput,
        or a list of such conversations, answered with a list (of one for a list of one);
        with SamplingParams(n=k), k replies per conversation, ordered as generate() orders
        them; with stream=True, an iterator of RequestOutputs carrying text deltas.
        chat_template_kwargs: more variables for the chat template, such as
        {"enable_thinking": False} for Qwen3's. chat_template: a Jinja template to render
        instead of the model's (vLLM's), in the same sandbox, or the name of one of the
        model's named templates (tokenizer_config.json's list); RequestError quoting the
        problem when it does not compile or render. continue_final_message=True: the reply
        continues the last message (an assistant's start, say) instead of answering it;
        add_generation_prompt (default: true unless continuing) as vLLM's.

        tools: OpenAI's [{"type": "function", "function": {"name", "description",
        "parameters"}}], shown to the chat template; tool_choice "auto" (the default with
        tools; the template sees the tools with every choice), "none" (no call: the reply
        is neither constrained nor parsed), "required" or {"type": "function", "function":
        {"name": ...}} (a call enforced by a grammar); parallel_tool_calls=False: at most
        one call (with "required" or a named function the grammar writes one; with "auto"
        the calls after the first are dropped, as vLLM drops them). Each finished reply is
        parsed (tool_call_parser, or the format the chat template shows): its calls go to
        RequestOutput.tool_calls, its other text to .content, and finish_reason becomes
        "tool_calls". Streamed replies are parsed as they come (the server's streaming
        parser): each output's `delta` is new content only, never a call's text, its
        `tool_call_deltas` the calls' new pieces; `text` stays the model's raw text, and
        the last output carries tool_calls, content and finish_reason as a reply that was
        not streamed would (README: except a reply broken off inside a call). A reasoning
        model's thinking (up to the </think> token, where the prompt opened it or the reply
        begins with <think>) is content as written, never calls: only the answer after it
        is parsed, and where the prompt opened the thinking a constraint (tool_choice's
        grammar, or params') starts after it. With LLM(reasoning_parser=...), a reply
        thinks as serve's parser says (Qwen3's: unless enable_thinking is false), and the
        constraint of every such reply starts after its thinking."""
        params = _vllm_params(params, sampling_params)
        if date_string is not None and not isinstance(date_string, str):
            raise RequestError(f"date_string must be a string such as '26 Jul 2024', got "
                               f"{type(date_string).__name__}")
        batch = (isinstance(messages, (list, tuple)) and bool(messages)
                 and isinstance(messages[0], (list, tuple)))
        conversations = list(messages) if batch else [messages]
        self._live_engine()
        tools, parser, params = self.tool_setup(tools, tool_choice, parallel_tool_calls,
                                                 tool_call_parser, params, chat_template,
                                                 chat_template_kwargs)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt,
                                              date_string=date_string, tools=tools,
                                              template_kwargs=chat_template_kwargs,
                                              continue_final_message=continue_final_message,
                                              chat_template=chat_template)
                   for c in conversations]
        if parser is not None or self.reasoning is not None:
            # a constraint (tool_choice's grammar, or params') after the reply's thinking
            each = self._param_list(params, len(prompts))
            gated = [self.constrain_after_thinking(p, one, chat_template_kwargs)
                     for p, one in zip(prompts, each)]
            if any(g is not one for g, one in zip(gated, each)):
                params = gated
        result = self.generate(prompts, params, stream=stream)
        max_calls = None if parallel_tool_calls else 1  # as vLLM: the first call only
        if parser is not None and stream:
            return self._stream_tool_calls(result, parser, max_calls, chat_template_kwargs)
        if parser is not None:
            for output in result if isinstance(result, list) else [result]:
                self.parse_tool_calls(output, parser, max_calls, chat_template_kwargs)
        if stream or batch or len(result) > 1:  # len > 1: one conversation, n replies
            return result
        return result[0]

    def tool_setup(self, tools, tool_choice, parallel_tool_calls, parser_name, params,
                   chat_template: str | None = None, template_kwargs: dict | None = None):
        """chat()'s tool arguments checked: (the tools the template shows or None, the
        parser of the replies or None, the params with the grammar that enforces
        tool_choice); without parser_name, the parser of the template the chat renders
        with (chat_template's where given, rendered with template_kwargs where it refuses
        tools). `generate`'s batch lines use it as chat() does."""
        from .tool_choice import check_tool_choice, check_tools, template_tools, tool_call_grammar
        from .tool_parsers import SPECIAL_TAG_PARSERS, check_parser_name, tool_parser_for_template

        tools = check_tools(tools)
        choice = check_tool_choice(tool_choice, tools)
        if parallel_tool_calls not in (True, False):
            raise RequestError(f"parallel_tool_calls must be true or false, got "
                               f"{parallel_tool_calls!r}")
        if choice == "none":
            return template_tools(self.tokenizer, tools, choice, chat_template,
                                  template_kwargs), None, params
        if parser_name is not None:
            parser_name = check_parser_name(parser_name, "tool_call_parser")
        else:
            parser_name = tool_parser_for_template(self.tokenizer.tools_template(chat_template))
            if parser_name is None:
                refusal = self.tokenizer.tools_refusal(tools, chat_template, template_kwargs)
                if refusal is not None:  # no parser would help
                    raise RequestError(refusal)
                raise RequestError("the model's chat template shows no tool-call format "
                                   "this engine knows; pass tool_call_parser= "
                                   "('llama3_json', 'hermes' or 'mistral')")
        grammar = tool_call_grammar(parser_name, tools, choice, parallel_tool_calls,
                                    token_id=self.tokenizer.token_to_id)
        changes = {}
        if grammar is not None:
            changes["structured"] = grammar
        if parser_name in SPECIAL_TAG_PARSERS or (
                self._thinking is not None and self._thinking.special):
            # the text keeps the tag the calls start at, or the thinking's markers, which
            # say where the answer (whose calls are read) starts
            changes["skip_special_tokens"] = False
        if changes:
            single = params is None or isinstance(params, SamplingParams)
            count = len(params) if isinstance(params, (list, tuple)) else 1  # one per prompt
            each = self._param_list(params, count)
            if grammar is not None and any(p.structured is not None for p in each):
                raise RequestError("tool_choice \"required\" or a named function sets the "
                                   "output's grammar; leave params.structured out")
            if grammar is not None and any(p.allowed_token_ids is not None for p in each):
                raise RequestError("tool_choice \"required\" or a named function sets the "
                                   "output's grammar; leave params.allowed_token_ids out")
            each = [replace(p, **changes) for p in each]
            params = each[0] if single else each
        return tools, parser_name, params

    def constrain_after_thinking(self, prompt: list[int], params: SamplingParams,
                                 template_kwargs: dict | None = None) -> SamplingParams:
        """The params of a chat prompt offered tools, or of any chat prompt with a
        reasoning_parser: where its reply starts thinking (reply_thinks), their constraint
        (tool_choice's grammar, or the params' own) starts after the </think> token, as
        serve's does with a reasoning parser: from the first token it would leave the model
        no thinking, and write the answer, calls and all, inside the thinking. chat() and
        generate's plain lines use it."""
        markers = self._thinking
        if (markers is None or params.structured is None
                or params.structured.starts_after is not None
                or not self.reply_thinks(prompt, [], template_kwargs)):
            return params
        return replace(params, structured=replace(params.structured,
                                                  starts_after=markers.end_token))

    def reply_thinks(self, prompt: list[int], token_ids: list[int],
                     template_kwargs: dict | None = None) -> bool:
        """Whether a chat reply (its tokens so far) starts by thinking: with a
        reasoning_parser, as serve's parser decides from the prompt and the template's
        keywords (ReasoningParser.thinks); without one, where the prompt opened the
        thinking or the reply's first token is <think> (ReasoningParser.reply_thinks)."""
        if self.reasoning is not None:
            return self.reasoning.thinks(prompt, template_kwargs)
        return self._thinking is not None and self._thinking.reply_thinks(prompt, token_ids)

    def parse_tool_calls(self, output: RequestOutput, parser_name: str,
                         max_calls: int | None = None, template_kwargs: dict | None = None
                         ) -> None:
        """A finished reply's calls into output.tool_calls and .content (tool_setup's
        parser); max_calls: the calls kept (1 for parallel_tool_calls false). Where the
        reply thinks (reply_thinks; template_kwargs: the chat template's keywords), only
        its answer is parsed: the thinking is content as written."""
        from .tool_parsers import parse_tool_calls

        thought, answer = self._thought_and_answer(output, template_kwargs)
        parsed = parse_tool_calls(answer, parser_name, max_calls=max_calls)
        output.content = (thought + (parsed.content or "")) or None
        if parsed.tool_calls:
            output.tool_calls = parsed.tool_calls
            if output.finish_reason == "stop":
                output.finish_reason = "tool_calls"

    def _stream_tool_calls(self, outputs, parser_name: str, max_calls: int | None = None,
                           template_kwargs: dict | None = None) -> Iterator[RequestOutput]:
        """The streamed outputs with each sample's text fed to its own tool-call parser."""
        from .tool_parsers import make_tool_parser

        samples = {}  # (request_id, index) -> its _AnswerCalls
        with closing(outputs):  # a caller that stops early aborts the requests at once
            for output in outputs:
                key = (output.request_id, output.index)
                if key not in samples:
                    samples[key] = _AnswerCalls(
                        make_tool_parser(parser_name, max_calls=max_calls), self._thinking,
                        lambda prompt, ids: self.reply_thinks(prompt, ids, template_kwargs))
                reader = samples[key]
                parser = reader.parser
                delta = reader.feed(output)
                if output.finished:
                    last = parser.finish()
                    delta.extend(last)
                    del samples[key]
                    parsed = parser.result()
                    output.content = (reader.thought + (parsed.content or "")) or None
                    if parsed.tool_calls:
                        output.tool_calls = parsed.tool_calls
                        if output.finish_reason == "stop":
                            output.finish_reason = "tool_calls"
                output.delta = delta.content
                output.tool_call_deltas = delta.tool_calls or None
                yield output

    def _thought_and_answer(self, output: RequestOutput, template_kwargs: dict | None = None
                            ) -> tuple[str, str]:
        """A finished reply's text as (its thinking as written, up to and with the </think>
        token's text, its answer); ("", text) where it does not think."""
        markers, text = self._thinking, output.text
        if markers is None or not self.reply_thinks(output.prompt_token_ids, output.token_ids,
                                                    template_kwargs):
            return "", text
        _, answer = split_reasoning(markers, text, output.token_ids, True)
        answer = answer or ""  # None: the thinking never ended
        return text[:len(text) - len(answer)], answer

    def _param_list(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            params = self.default_sampling_params()
        # copies (replace runs SamplingParams' checks again, on values set since)
        if isinstance(params, SamplingParams):
            return [replace(params) for _ in range(count)]
        if isinstance(params, (str, bytes, dict)) or not hasattr(params, "__iter__"):
            raise RequestError(f"params must be a SamplingParams or a list of them (one per "
                               f"prompt), got {type(params).__name__}")
        params = list(params)
        if len(params) != count:
            raise RequestError(f"give one SamplingParams or a list of {count} (one per prompt), "
                               f"got a list of {len(params)}")
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise RequestError(f"params: every element must be a SamplingParams, got "
                               f"{type(wrong).__name__}")
        return [replace(p) for p in params]


class _AnswerCalls:
    """One streamed sample's text for LLM.chat with tools: where it thinks, its thinking
    passes as written and only the answer after the </think> token goes to the tool-call
    parser, as the server's chat stream feeds the reasoning splitter's answer to it."""

    def __init__(self, parser, markers, thinks):
        """thinks(prompt ids, reply ids so far): whether the reply thinks (LLM.reply_thinks)."""
        self.parser = parser
        self.thought = ""  # the thinking so far, as written
        self._markers, self._thinks = markers, thinks
        self._splitter: ReasoningSplitter | None = None
        self._decided = markers is None  # whether it thinks: known at its first token

    def feed(self, output: RequestOutput):
        """The output's new text as the parser's delta, the thinking first as content."""
        if not self._decided and output.token_ids:
            self._decided = True
            if self._thinks(output.prompt_token_ids, output.token_ids):
                self._splitter = ReasoningSplitter(self._markers, True)
        text = answer = output.delta
        if self._splitter is not None:  # the answer's text is the end of the piece's
            _, answer = self._splitter.feed(text, output.delta_token_ids)
        thinking = text[:len(text) - len(answer)]
        self.thought += thinking
        delta = self.parser.feed(answer)
        delta.content = thinking + delta.content
        return delta


def _vllm_params(params, sampling_params):
    """The SamplingParams given as params or by vLLM's keyword, sampling_params."""
    if sampling_params is None:
        return params
    if params is not None:
        raise RequestError("give the SamplingParams once: as params or as sampling_params "
                           "(vLLM's name for it), not both")
    return sampling_params


def _as_prompt_list(prompts) -> tuple[bool, list]:
    if isinstance(prompts, (str, dict)):
        return True, [_prompt_of(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and are_token_ids(prompts):
        return True, [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return False, [_prompt_of(prompt) for prompt in prompts]
    raise RequestError(f"prompts must be a string, a list of token ids or a list of those, "
                       f"got {type(prompts).__name__}")


def _prompt_of(prompt):
    """vLLM's prompt dicts, TextPrompt {"prompt": text} and TokensPrompt
    {"prompt_token_ids": ids}, as the text or ids they hold; any other prompt as it is."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise RequestError(f"a prompt dict's 'prompt' must be text, got "
                               f"{type(prompt['prompt']).__name__} (token ids go in "
                               f"{{'prompt_token_ids': ids}})")
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"a prompt dict's 'prompt_token_ids' must be a list of token "
                               f"ids, got {type(ids).__name__} (text goes in {{'prompt': "
                               f"text}}; Tokenizer.apply_chat_template gives ids with "
                               f"tokenize=True)")
        if not are_token_ids(ids):
            bad = next(value for value in ids if not is_token_id(value))
            raise RequestError(f"a prompt dict's 'prompt_token_ids' must be a list of token "
                               f"ids (integers >= 0), got the element {bad!r}")
        return list(ids)
    raise RequestError(f"a prompt dict must be {{'prompt': text}} or {{'prompt_token_ids': "
                       f"[ids]}} (vLLM's TextPrompt and TokensPrompt), got the keys "
                       f"{sorted(map(str, prompt))}")

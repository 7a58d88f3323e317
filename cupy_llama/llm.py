"""The public Python API: LLM(model_dir).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Iterator

from .config import EngineConfig, ModelConfig
from .engine.llm_engine import LLMEngine
from .errors import ConfigError, RequestError
from .outputs import RequestOutput, is_token_id
from .sampling import SamplingParams, generation_defaults, model_sampling_defaults
from .weights import open_checkpoint

DEVICES = ("auto", "cpu", "cuda")


GPU_ONLY_OPTIONS = ("enforce_eager", "gpu_memory_utilization")  # the CPU backend has neither


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class LLM:
    """A model loaded on one device, ready to generate.

    >>> llm = LLM("path/to/model", device="cpu")
    >>> llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8)).text
    """

    def __init__(self, model_dir, device: str = "auto", *, log=_stderr, **engine_options):
        if device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        from .tokenizer import Tokenizer

        if not isinstance(model_dir, (str, os.PathLike)):
            raise ConfigError(f"model_dir must be the path of a model folder, got "
                              f"{type(model_dir).__name__}")
        options = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - options)
        if unknown:
            raise ConfigError(f"unknown LLM option {unknown[0]!r}; the options are "
                              f"{', '.join(sorted(options))}")
        started = time.perf_counter()
        log = log or (lambda message: None)  # None: silent
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        generation_defaults(self.config.generation_config)  # a bad default fails the load
        self.device = self._pick_device(device, log)
        if self.device == "cpu":
            ignored = [name for name in GPU_ONLY_OPTIONS if name in engine_options]
            if ignored:
                verb = "applies" if len(ignored) == 1 else "apply"
                log(f"warning: {' and '.join(ignored)} {verb} to the GPU only; ignored on the CPU")
            # modest defaults: the NumPy backend serves tests and small models
            engine_options.setdefault("max_num_seqs", 16)
            engine_options.setdefault("max_num_batched_tokens", 2048)
        self.engine_config = EngineConfig(**engine_options)
        self.max_model_len = self.engine_config.resolved_max_model_len(self.config)
        self.tokenizer = Tokenizer.from_dir(self.model_dir, self.config)
        self.tokenizer.check_chat_template()  # a broken template fails the load, not a chat
        checkpoint = open_checkpoint(self.model_dir, self.config, log=log)
        try:
            self.backend = self._make_backend(checkpoint, log)
        finally:
            checkpoint.close()
        self.engine = LLMEngine(self.config, self.tokenizer, self.backend, self.engine_config,
                                self.max_model_len)
        self.load_seconds = time.perf_counter() - started

    def _pick_device(self, device: str, log) -> str:
        if device == "cpu":
            return "cpu"
        from .backends.cuda import check_cuda_device, cuda_usable
        if device == "cuda":
            check_cuda_device()
            return "cuda"
        usable, reason = cuda_usable()
        if not usable:
            log(f"warning: running on the CPU (slow): {reason}")
            return "cpu"
        return "cuda"

    def _make_backend(self, checkpoint, log):
        ec = self.engine_config
        if self.device == "cpu":
            from .backends.cpu import CpuBackend
            return CpuBackend(self.config, checkpoint, max_model_len=self.max_model_len,
                              max_num_seqs=ec.max_num_seqs, block_size=ec.block_size,
                              num_kv_blocks=ec.num_kv_blocks, log=log)
        from .backends.cuda import CudaBackend
        return CudaBackend(self.config, checkpoint, max_model_len=self.max_model_len,
                           max_num_seqs=ec.max_num_seqs,
                           max_num_batched_tokens=ec.max_num_batched_tokens,
                           block_size=ec.block_size, num_kv_blocks=ec.num_kv_blocks,
                           gpu_memory_utilization=ec.gpu_memory_utilization,
                           enforce_eager=ec.enforce_eager, log=log)

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        """Hand the device memory back (weights, KV cache, buffers); the LLM cannot generate
        afterwards. `with LLM(...) as llm:` closes at the end of the block. A dropped LLM
        that was never closed gives its GPU memory back when the next one is made."""
        if self.engine is not None:
            self.engine.close()
            self.backend.close()
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
            raise RequestError("this LLM is closed; make a new one to generate")
        return self.engine

    # ---- generation -----------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults."""
        return SamplingParams(**model_sampling_defaults(self.config.generation_config))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 *, stream: bool = False):
        """prompts: a string, a list of token ids, or a list of either. Returns one
        RequestOutput per prompt in order (a single one for a single prompt); with
        SamplingParams(n=k), k per prompt, as one flat list ordered by prompt and then by
        sample (RequestOutput.index), a list of k for a single prompt. With stream=True,
        an iterator of RequestOutputs carrying text deltas, each with its request_id and
        index."""
        single, prompts = _as_prompt_list(prompts)
        param_list = self._param_list(params, len(prompts))
        engine = self._live_engine()
        if stream:
            return engine.stream(prompts, param_list)
        outputs = engine.generate(prompts, param_list)
        return outputs[0] if single and param_list[0].n == 1 else outputs

    def stream(self, prompts, params=None) -> Iterator[RequestOutput]:
        return self.generate(prompts, params, stream=True)

    def chat(self, messages, params: SamplingParams | None = None, *, stream: bool = False,
             date_string: str | None = None):
        """messages: [{"role": ..., "content": ...}, ...], answered with one RequestOutput,
        or a list of such conversations, answered with a list (of one for a list of one);
        with SamplingParams(n=k), k replies per conversation, ordered as generate() orders
        them; with stream=True, an iterator of RequestOutputs carrying text deltas."""
        if date_string is not None and not isinstance(date_string, str):
            raise RequestError(f"date_string must be a string such as '26 Jul 2024', got "
                               f"{type(date_string).__name__}")
        batch = (isinstance(messages, (list, tuple)) and bool(messages)
                 and isinstance(messages[0], (list, tuple)))
        conversations = list(messages) if batch else [messages]
        self._live_engine()
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True, date_string=date_string)
                   for c in conversations]
        result = self.generate(prompts, params, stream=stream)
        if stream or batch or len(result) > 1:  # len > 1: one conversation, n replies
            return result
        return result[0]

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


def _as_prompt_list(prompts) -> tuple[bool, list]:
    if isinstance(prompts, str):
        return True, [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(is_token_id(t) for t in prompts):
        return True, [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return False, list(prompts)
    raise RequestError(f"prompts must be a string, a list of token ids or a list of those, "
                       f"got {type(prompts).__name__}")

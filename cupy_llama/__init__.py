"""cupy-llama: a small, fast, readable LLM inference engine for the Llama, Mistral, Qwen
and Gemma families.

    from cupy_llama import LLM, SamplingParams
    llm = LLM("path/to/model")            # device="auto": the GPU when usable, else the CPU
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=32))
    print(out.text)
"""
from .errors import CupyLlamaError
from .outputs import RequestOutput
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CupyLlamaError", "__version__"]


def __getattr__(name):
    # LLM pulls in the tokenizer and backends; import it on first use
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(f"module 'cupy_llama' has no attribute {name!r}")

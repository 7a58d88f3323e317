"""The transformers baseline of `cupy-llama bench`: the same workloads through Hugging
Face transformers, in the same process, after cupy-llama has released the GPU."""
from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path

from .report import _num
from .workloads import (THROUGHPUT_MAX_TOKEN_ID, THROUGHPUT_TEMPERATURE, TTFT_RUNS,
                              BenchSettings, Workload, random_ids, throughput_numbers,
                              throughput_workload)
from ..errors import DeviceError, RequestError


def check_hf_available(device: str) -> None:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise RequestError("--hf needs torch and transformers (pip install torch transformers); "
                           "run without --hf to skip the baseline") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--hf: torch cannot see a CUDA GPU (a CPU-only torch build?); install "
                          "a CUDA build of torch or run without --hf")


def run_hf(model_dir: Path, settings: BenchSettings, results: dict, log, save) -> dict:
    """Loads the model in transformers and runs each mode's workload; a failing mode is
    recorded with its error and the others still run."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    on_gpu = settings.device == "cuda"
    started = time.perf_counter()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to("cuda" if on_gpu else "cpu").eval()
    load_s = time.perf_counter() - started
    info = {"version": transformers.__version__, "load_s": load_s,
            "dtype": str(dtype).replace("torch.", ""),
            "attn_implementation": model.config._attn_implementation}
    log(f"transformers {transformers.__version__}: loaded in {load_s:.2f} s "
        f"({info['attn_implementation']} attention, {info['dtype']})")
    hf = HfRunner(model, torch, on_gpu, settings, max_token_id=min(
        THROUGHPUT_MAX_TOKEN_ID, model.config.vocab_size - 1))
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    # continuous batching (throughput) last: it switches the model's attention to paged
    for mode in sorted(settings.modes, key=lambda m: m == "throughput"):
        try:
            results[mode]["transformers"] = HF_MODES[mode](hf, results[mode]["cupy_llama"], log)
        except Exception as e:  # the baseline must not cost the numbers already measured
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            results[mode]["transformers"] = {"error": f"{type(e).__name__}: {message}"}
            log(f"transformers {mode} failed: {message}")
        save()
    if on_gpu:
        info["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        info["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    del model, hf
    gc.collect()
    return info


class HfRunner:
    """The same workloads through transformers: `generate`, and continuous batching."""

    def __init__(self, model, torch, on_gpu: bool, settings: BenchSettings, max_token_id: int):
        self.model, self.torch, self.on_gpu = model, torch, on_gpu
        self.settings, self.max_token_id = settings, max_token_id

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def generate(self, prompts: list[list[int]], new_tokens: int):
        """Greedy, exactly new_tokens each (EOS cannot stop it early); prompts of one length."""
        torch = self.torch
        ids = torch.tensor(prompts, device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)
        self.sync()
        if out.shape[1] - ids.shape[1] != new_tokens:
            got = out.shape[1] - ids.shape[1]
            raise RuntimeError(f"generate gave {got} tokens, not {new_tokens}")
        return out

    def timed(self, prompts, new_tokens: int) -> float:
        started = time.perf_counter()
        self.generate(prompts, new_tokens)
        return time.perf_counter() - started

    def random_prompts(self, rng, batch: int, length: int) -> list[list[int]]:
        return [random_ids(rng, length, self.max_token_id) for _ in range(batch)]

    def decode_rate(self, rng, batch: int, length: int, new_tokens: int) -> dict:
        """tok/s after the first token: (full run - a one-token run) over the tokens after
        each request's first."""
        full = self.timed(self.random_prompts(rng, batch, length), new_tokens)
        first = statistics.median(self.timed(self.random_prompts(rng, batch, length), 1)
                                  for _ in range(3))
        tokens = batch * (new_tokens - 1)
        return {"tok_s": tokens / (full - first) if full > first else None, "full_run_s": full,
                "first_token_s": first}


def hf_latency(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    started = time.perf_counter()
    hf.generate(hf.random_prompts(rng, 1, ours["prompt_tokens"]), 8)
    warmup_s = time.perf_counter() - started
    result = {"method": "generate, batch 1, greedy", "warmup_s": warmup_s,
              **hf.decode_rate(rng, 1, ours["prompt_tokens"], ours["new_tokens"])}
    result["ms_per_token"] = 1e3 / result["tok_s"] if result["tok_s"] else None
    log(f"transformers latency: {_num(result['tok_s'], 1)} tok/s")
    return result


def hf_ttft(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    rows = []
    for row in ours["prompts"]:
        length = row["prompt_tokens"]
        hf.generate(hf.random_prompts(rng, 1, length), 1)
        times = [1e3 * hf.timed(hf.random_prompts(rng, 1, length), 1) for _ in range(TTFT_RUNS)]
        rows.append({"prompt_tokens": length, "ttft_ms": statistics.median(times),
                     "runs_ms": times})
        log(f"transformers ttft: {length}-token prompt: {rows[-1]['ttft_ms']:.2f} ms")
    return {"method": "generate with max_new_tokens=1", "prompts": rows}


def hf_decode_sweep(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    hf.generate(hf.random_prompts(rng, 1, ours["prompt_tokens"]), 4)
    rows = []
    for row in ours["rows"]:
        rows.append({"batch": row["batch"],
                     **hf.decode_rate(rng, row["batch"], ours["prompt_tokens"],
                                      ours["new_tokens"])})
        log(f"transformers decode-sweep: batch {row['batch']}: {_num(rows[-1]['tok_s'])} tok/s")
    return {"method": "generate, greedy, equal-length prompts (no padding)", "rows": rows}


def hf_throughput(hf: HfRunner, ours: dict, log) -> dict:
    """Continuous batching when this transformers has it (the manager behind
    `generate_batch`, given each request its own max_new_tokens, which `generate_batch`
    cannot); otherwise `generate` on padded batches."""
    work = throughput_workload(hf.settings, hf.max_token_id)
    if hf.on_gpu:
        hf.torch.cuda.empty_cache()  # continuous batching sizes its cache from the free memory
    manager_cm = getattr(hf.model, "continuous_batching_context_manager", None)
    if manager_cm is not None and _accepts(_manager_add_request(), "max_new_tokens"):
        result = _hf_continuous(hf, work, manager_cm)
    else:
        result = _hf_padded(hf, work)
    log(f"transformers throughput ({result['method']}): {result['output_tok_s']:,.0f} output tok/s")
    return result


def _manager_add_request():
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return None
    return getattr(ContinuousBatchingManager, "add_request", None)


def _accepts(fn, name: str) -> bool:
    import inspect
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _hf_continuous(hf: HfRunner, work: Workload, manager_cm) -> dict:
    from transformers import GenerationConfig
    hf.torch.manual_seed(hf.settings.seed)
    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=True,
                              temperature=THROUGHPUT_TEMPERATURE, top_k=0, top_p=1.0)
    config.eos_token_id = None  # continuous batching then runs with EOS disabled (-1)
    options = {"generation_config": config, "block": True, "timeout": 30}
    if _accepts(manager_cm, "workload_hints"):
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = {"max_prompt_length": max(map(len, work.prompts)),
                 "max_generated_length": max(work.output_lens), "num_requests": len(work.prompts)}
        known = getattr(WorkloadHints, "__dataclass_fields__", hints)
        options["workload_hints"] = WorkloadHints(**{k: v for k, v in hints.items() if k in known})
    started = time.perf_counter()
    with manager_cm(**options) as manager:
        run_started = time.perf_counter()  # warm-up (graph capture) is done, the loop runs
        eos = {"eos_token_id": -1} if _accepts(manager.add_request, "eos_token_id") else {}
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, **eos)
        finished = {}
        while len(finished) < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"the continuous batching loop stopped after "
                                       f"{len(finished)} of {len(work.prompts)} requests")
                continue
            if result.is_finished():
                finished[result.request_id] = result
        wall_s = time.perf_counter() - run_started
    errors = [r.error for r in finished.values() if getattr(r, "error", None)]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    output_tokens = sum(len(r.generated_tokens) for r in finished.values())
    return {"method": "continuous batching (ContinuousBatchingManager, as generate_batch "
                      "uses it), per-request max_new_tokens",
            "warmup_s": run_started - started, **throughput_numbers(work, output_tokens, wall_s)}


def _hf_padded(hf: HfRunner, work: Workload, batch: int = 64) -> dict:
    """Padded `generate` in batches of similar prompt length; each batch runs to its
    longest output, and only the requested tokens count as output."""
    torch = hf.torch
    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    hf.generate([work.prompts[order[0]][:8]], 2)  # warm-up
    hf.torch.manual_seed(hf.settings.seed)
    started = time.perf_counter()
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        width = max(len(work.prompts[i]) for i in chunk)
        new_tokens = max(work.output_lens[i] for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):  # left padding
            prompt = work.prompts[i]
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.no_grad():
            hf.model.generate(ids.to(hf.model.device), attention_mask=mask.to(hf.model.device),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=True, temperature=THROUGHPUT_TEMPERATURE, top_k=0,
                              top_p=1.0, pad_token_id=0)
    hf.sync()
    wall_s = time.perf_counter() - started
    return {"method": f"generate on left-padded batches of {batch}",
            **throughput_numbers(work, sum(work.output_lens), wall_s)}


HF_MODES = {"throughput": hf_throughput, "latency": hf_latency, "ttft": hf_ttft,
            "decode-sweep": hf_decode_sweep}

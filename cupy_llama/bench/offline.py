"""`cupy-llama bench`: the standard workloads, timed honestly, beside transformers.

Modes (docs/ARCHITECTURE.md, "Performance model"):
  throughput    the standard offline workload: 256 requests; prompt and output lengths
                uniform in [100, 1024]; prompt ids uniform in [0, 10000]; EOS ignored;
                temperature 0.6; all requests at once. Drawn with Python's `random` seeded
                with --seed in the order nano-vllm's bench.py draws them, so seed 0 gives
                the same requests. Throughput = output tokens / wall time.
  latency       batch-1 greedy decode, 32-token prompt, 256 new tokens: tok/s with the
                clock started at the first token, and on the GPU the fraction of the
                bandwidth floor (the bytes read per step over a device-to-device copy
                bandwidth measured in the same run).
  ttft          time to first token of 128-, 1,024- and 4,096-token prompts (median).
  decode-sweep  greedy decode tok/s at batch 1, 8, 32, 64, 128, 256 (prompt 128, 128 new
                tokens), counting the tokens after every request has its first one.
                latency and decode-sweep time the engine's steps on token ids: no text
                is made while they run (timed_steps says why).
  all           every mode above on one loaded model, one JSON.
  prefix        prefix caching, on and then off, on one loaded model (greedy, EOS ignored):
                (a) 64 requests share a 2,048-token prefix, each with a 64-token suffix of
                its own, 32 new tokens each: the first runs alone (with caching on it fills
                the cache), then the other 63 together; TTFT of the first and the median of
                the rest, and throughput. (b) a 10-turn chat: each turn sends the whole
                conversation so far (its replies' token ids as generated) plus a 100-token
                message, and gets a 32-token reply; TTFT of every turn. --scale shortens
                every length; there is no transformers baseline.

Load, warm-up and run times are reported apart; statistics go to stderr while running,
a short table to stdout at the end. With --hf the same workloads run through Hugging
Face transformers in the same process, after cupy-llama has released the GPU.

On the CPU (the NumPy reference backend) the same workloads check the engine end to end;
the default model is the tiny preset, and there is no bandwidth floor: no quick host
measurement bounds how fast the backend reads the weights. A tiny model's weights sit in
the caches; a large one's are read by all of BLAS's threads at once, faster than one
thread's memcpy copies, so a floor from a host copy comes out below the measured speed.
"""
from __future__ import annotations

import gc
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from .report import (_num, add_ratios, commit_info, environment, format_table, sweep_batch,
                           write_report)
from .workloads import (CHAT_MESSAGE, CHAT_REPLY, CHAT_TURNS, DEFAULT_BATCH_SIZES,
                              LATENCY_NEW_TOKENS, LATENCY_PROMPT, LATENCY_RUNS, MODEL_SEED,
                              PREFIX_NEW_TOKENS, PREFIX_REQUESTS, PREFIX_SHARED, PREFIX_SUFFIX,
                              SWEEP_NEW_TOKENS, SWEEP_PROMPT, THROUGHPUT_MAX_TOKEN_ID,
                              THROUGHPUT_TEMPERATURE, TTFT_LENGTHS, TTFT_RUNS, BenchSettings,
                              prepare_model, random_ids, throughput_numbers, throughput_workload)
from ..errors import OptionError
from ..sampling import SamplingParams



COPY_BYTES = 1 << 30


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the run ------------------------------------------------------------------------------

def run_bench(settings: BenchSettings, log=_stderr) -> dict:
    """Runs the settings' modes (then the transformers baselines) and returns the report;
    writes it as JSON when settings.json_path is set."""
    if settings.hf:
        from .hf import check_hf_available
        check_hf_available(settings.device)
    if settings.model_dir is not None:  # a bad model folder fails before any measuring
        from ..models import read_config
        read_config(settings.model_dir)
    on_gpu = settings.device == "cuda"
    device = DeviceProbe(settings.device)
    report = {"command": settings.command(), "argv": list(sys.argv), **commit_info(settings.commit),
              "environment": environment(settings.device, settings.hf),
              "device": {"kind": settings.device, "name": device.name}}
    if not on_gpu:
        log(f"bench on the CPU: the NumPy reference backend (float32) with "
            f"{settings.model_dir or 'a random ' + settings.preset + ' model'}. This checks the "
            "engine end to end on the host (scheduling, sampling, the NumPy ops); it does not "
            "measure a GPU, and it has no bandwidth floor and no kernel compile")
    if on_gpu and settings.mode in ("all", "latency"):
        report["device"]["copy_bandwidth_bytes_s"] = device.copy_bandwidth()
        log(f"device copy bandwidth: {report['device']['copy_bandwidth_bytes_s'] / 1e9:,.0f} GB/s "
            "(read + write)")
    model_dir, made_s = prepare_model(settings, log)
    memory = {"used_before_load": device.used_bytes()}

    from ..llm import LLM
    started = time.perf_counter()
    llm = LLM(model_dir, device=settings.device, log=log, **settings.engine_options())
    load_s = time.perf_counter() - started
    memory["used_after_load"] = device.used_bytes()
    warmup_s = warm_up(llm, settings)
    memory["used_after_warmup"] = device.used_bytes()
    log(f"load {load_s:.2f} s, warm-up{' (kernel compile)' if on_gpu else ''} {warmup_s:.2f} s")
    report["model"] = describe_model(llm, model_dir, settings, made_s)
    report["settings"] = {**run_settings(settings), "engine": asdict(llm.engine_config),
                          "max_model_len": llm.context_limit}
    report["timings"] = {"load_s": load_s, "warmup_s": warmup_s}

    results, peaks = {}, [memory["used_after_warmup"]]
    report["results"] = results
    for mode in settings.modes:
        results[mode] = {"cupy_llama": OUR_MODES[mode](llm, settings, device, log)}
        peaks.append(device.used_bytes())
    memory["peak_used"] = None if peaks[0] is None else max(peaks)
    report["memory"] = memory_report(llm, device, memory)
    release(llm, device)
    del llm

    def save():  # after each stage, so a run stopped later still leaves its numbers
        if settings.json_path:
            write_report(settings.json_path, report)

    save()
    if settings.hf:
        from .hf import run_hf
        report["transformers"] = run_hf(model_dir, settings, results, log, save)
        add_ratios(results)
        save()
    if settings.json_path:
        log(f"wrote {settings.json_path}")
    return report


def run_settings(settings: BenchSettings) -> dict:
    return {"modes": list(settings.modes), "seed": settings.seed, "scale": settings.scale,
            "num_requests": settings.num_requests, "batch_sizes": list(settings.batch_sizes),
            "hf": settings.hf, "engine_options_given": dict(settings.engine),
            "sampling": {"throughput": f"temperature {THROUGHPUT_TEMPERATURE}, top-p 1, "
                                       "seed --seed + request index, EOS ignored",
                         "other modes": "greedy, EOS ignored"},
            "prefix_caching": "on" if settings.engine.get("enable_prefix_caching", True)
            else "off (--no-prefix-caching)"}


def warm_up(llm, settings: BenchSettings) -> float:
    """Runs every kind of step once before anything is timed (kernel compilation, first
    use of each decode batch size): prefill of a few prompt lengths, greedy and sampled
    decode, and decode at each sweep batch size the engine can hold."""
    started = time.perf_counter()
    rng = random.Random(settings.seed + 1)
    top = max_token_id(llm)
    most = llm.engine_config.max_num_seqs
    prompts = [random_ids(rng, 8 + 24 * i, top) for i in range(min(4, most))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.generate(prompts[0], SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True, seed=0))
    for batch in sorted({b for b in DEFAULT_BATCH_SIZES if b <= most} | {most}):
        llm.generate([random_ids(rng, 8, top) for _ in range(batch)],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    return time.perf_counter() - started


def max_token_id(llm) -> int:
    return min(THROUGHPUT_MAX_TOKEN_ID, llm.config.vocab_size - 1)


# ---- cupy-llama's modes -------------------------------------------------------------------

def run_throughput(llm, settings: BenchSettings, device, log) -> dict:
    work = throughput_workload(settings, max_token_id(llm))
    params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                             seed=settings.seed + i) for i, n in enumerate(work.output_lens)]
    before = llm.engine.stats()
    started = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    wall_s = time.perf_counter() - started
    after = llm.engine.stats()
    result = throughput_numbers(work, sum(len(o.token_ids) for o in outputs), wall_s)
    # the engine's side, as bench serve reports it from the server's counters
    steps = after.num_steps - before.num_steps
    result["engine"] = {"steps": steps,
                        "preemptions": after.num_preemptions - before.num_preemptions,
                        "ms_per_step": 1e3 * wall_s / steps if steps else None}
    log(f"throughput: {result['num_requests']} requests, {result['output_tokens']:,} output "
        f"tokens in {wall_s:.2f} s: {result['output_tok_s']:,.0f} output tok/s, "
        f"{result['total_tok_s']:,.0f} total tok/s, {result['requests_s']:.1f} req/s")
    return result


def timed_steps(llm, prompts: list[list[int]], params: SamplingParams):
    """Runs the requests step by step; returns the start time and (time, tokens by
    request id) per step, each time taken once the step's tokens are on the host. The
    requests make token ids only (add_request's text=False): no text is made while the
    steps are timed. With text made token by token for 256 streamed requests the host's
    share of a step is about as long as the GPU's, and a step then becomes the host's
    in some runs and not in others (benchmarks/NOTES.md, "Where a batch-256 engine step
    goes")."""
    engine = llm.engine
    ids, steps = [], []
    started = time.perf_counter()
    try:
        ids = [engine.add_request(p, replace(params), text=False) for p in prompts]
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps.append((time.perf_counter(),
                          {o.request_id: len(o.delta_token_ids) for o in outputs}))
    finally:
        for request_id in ids:
            engine.abort(request_id)
    return started, steps


def decode_numbers(started: float, steps, num_requests: int) -> dict:
    """The clock starts at the step that gave the last request its first token; every
    token after that counts."""
    seen: set[str] = set()
    first = None
    for index, (stamp, tokens) in enumerate(steps):
        seen.update(tokens)
        if len(seen) == num_requests:
            first = index
            break
    if first is None:
        raise RuntimeError("a request finished without a token")  # engine bug, not user error
    after = steps[first + 1:]
    tokens = sum(sum(t.values()) for _, t in after)
    elapsed = steps[-1][0] - steps[first][0]
    return {"time_to_all_first_tokens_s": steps[first][0] - started,
            "decode_tokens": tokens, "decode_s": elapsed, "decode_steps": len(after),
            "tok_s": tokens / elapsed if elapsed > 0 else None,
            "ms_per_step": 1e3 * elapsed / len(after) if after else None}


def run_latency(llm, settings: BenchSettings, device, log) -> dict:
    prompt_len = settings.scaled(LATENCY_PROMPT)
    new_tokens = settings.scaled(LATENCY_NEW_TOKENS, least=2)
    rng = random.Random(settings.seed)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    warmup_s, runs = batch1_runs(llm, lambda: random_ids(rng, prompt_len, max_token_id(llm)),
                                 params)
    tok_s = statistics.median(r["tok_s"] for r in runs)
    result = {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "warmup_s": warmup_s,
              "tok_s": tok_s, "ms_per_token": 1e3 / tok_s,
              "runs_tok_s": [r["tok_s"] for r in runs],
              "ttft_ms": statistics.median(1e3 * r["time_to_all_first_tokens_s"] for r in runs)}
    floor = ""
    if settings.device == "cuda":  # the CPU has no floor (the module's docstring says why)
        result.update(bandwidth_floor(llm.config, device.copy_bandwidth(), tok_s))
        floor = (f", {100 * result['fraction_of_floor']:.0f}% of the bandwidth floor "
                 f"({result['floor_tok_s']:,.0f} tok/s)")
    log(f"latency: batch 1, {prompt_len}-token prompt, {new_tokens} new tokens: {tok_s:,.1f} tok/s "
        f"({result['ms_per_token']:.3f} ms/token){floor}")
    return result


def batch1_runs(llm, prompt, params: SamplingParams) -> tuple[float, list[dict]]:
    """A warm-up decode, then LATENCY_RUNS timed ones, each of one sequence with the
    prompt ids `prompt()` returns; (warm-up seconds, each run's decode_numbers)."""
    started = time.perf_counter()
    timed_steps(llm, [prompt()], params)
    warmup_s = time.perf_counter() - started
    return warmup_s, [decode_numbers(*timed_steps(llm, [prompt()], params), 1)
                      for _ in range(LATENCY_RUNS)]


def bandwidth_floor(config, bandwidth: float, tok_s: float) -> dict:
    """The GPU's batch-1 decode floor: the bytes one step must read over the device's
    bandwidth. Those bytes: every layer weight, the final norm and the LM head matrix, as
    the weight blob stores them (bf16; FP8 projections: a byte per weight and a scale per
    row). The embedding lookup reads one row per token, so a tied embedding counts once
    (read in full as the head) and an untied one not at all."""
    from ..models import model_for
    plan, _ = model_for(config).weight_plan()
    read = [entry for key, entry in plan.items()
            if key != "embed" or config.tie_word_embeddings]
    weight_bytes = sum(entry.nbytes for entry in read)
    read_params = sum(int(np.prod(entry.shape)) for entry in read if entry.dtype != "f32")
    floor_s = weight_bytes / bandwidth
    return {"weight_bytes_per_step": weight_bytes,
            "bytes_per_parameter": round(weight_bytes / read_params, 4),
            "copy_bandwidth_bytes_s": bandwidth, "floor_ms_per_token": 1e3 * floor_s,
            "floor_tok_s": 1 / floor_s, "fraction_of_floor": tok_s * floor_s}


def run_ttft(llm, settings: BenchSettings, device, log) -> dict:
    rng = random.Random(settings.seed)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    longest = llm.context_limit - 1
    rows, warmup_s = [], 0.0
    for wanted in TTFT_LENGTHS:
        length = min(settings.scaled(wanted), longest)
        if rows and length == rows[-1]["prompt_tokens"]:
            continue  # a context too short for this length: its row would repeat the last
        started = time.perf_counter()
        llm.generate(random_ids(rng, length, max_token_id(llm)), one)
        warmup_s += time.perf_counter() - started
        times = []
        for _ in range(TTFT_RUNS):
            prompt = random_ids(rng, length, max_token_id(llm))  # a fresh prompt: no cache hits
            started = time.perf_counter()
            llm.generate(prompt, one)
            times.append(1e3 * (time.perf_counter() - started))
        rows.append({"nominal_tokens": wanted, "prompt_tokens": length,
                     "ttft_ms": statistics.median(times), "runs_ms": times})
        log(f"ttft: {length}-token prompt: {rows[-1]['ttft_ms']:.2f} ms (median of {TTFT_RUNS})")
    return {"prompts": rows, "warmup_s": warmup_s}


def run_decode_sweep(llm, settings: BenchSettings, device, log) -> dict:
    rng = random.Random(settings.seed)
    prompt_len = settings.scaled(SWEEP_PROMPT)
    new_tokens = settings.scaled(SWEEP_NEW_TOKENS, least=2)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    top = max_token_id(llm)
    rows, warmup_s = [], 0.0
    for batch in settings.batch_sizes:
        started = time.perf_counter()
        timed_steps(llm, [random_ids(rng, prompt_len, top) for _ in range(batch)], warm)
        warmup_s += time.perf_counter() - started
        prompts = [random_ids(rng, prompt_len, top) for _ in range(batch)]
        row = {"batch": batch, **decode_numbers(*timed_steps(llm, prompts, params), batch)}
        row["one_batch"] = batch <= llm.engine_config.max_num_seqs
        row["max_num_seqs"] = llm.engine_config.max_num_seqs
        rows.append(row)
        log(f"decode-sweep: batch {sweep_batch(row)}: {_num(row['tok_s'])} tok/s "
            f"({_num(row['ms_per_step'], 2)} ms/step)")
    return {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "rows": rows,
            "warmup_s": warmup_s}


def timed_requests(llm, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Adds the requests at once and steps until they finish; each one's time to first
    token from that moment (taken once the step's tokens are on the host), its cached
    prompt tokens and its output ids."""
    engine = llm.engine
    ids, first, final = [], {}, {}
    started = time.perf_counter()
    try:
        ids = [engine.add_request(p, replace(params)) for p in prompts]
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                if output.delta_token_ids:
                    first.setdefault(output.request_id, now)
                if output.finished:
                    final[output.request_id] = output
    finally:
        for request_id in ids:
            engine.abort(request_id)
    wall_s = time.perf_counter() - started
    return {"ttft_s": [first[i] - started for i in ids], "wall_s": wall_s,
            "cached_tokens": [final[i].num_cached_tokens for i in ids],
            "token_ids": [final[i].token_ids for i in ids]}


def prefix_workload(settings: BenchSettings, top: int) -> dict:
    rng = random.Random(settings.seed)
    shared = random_ids(rng, settings.scaled(PREFIX_SHARED), top)
    return {"prompts": [shared + random_ids(rng, settings.scaled(PREFIX_SUFFIX), top)
                        for _ in range(PREFIX_REQUESTS)],
            "shared_tokens": len(shared),
            "messages": [random_ids(rng, settings.scaled(CHAT_MESSAGE), top)
                         for _ in range(CHAT_TURNS)]}


def shared_prefix_run(llm, prompts: list[list[int]], params: SamplingParams) -> dict:
    first = timed_requests(llm, prompts[:1], params)  # alone: with caching on it fills the cache
    rest = timed_requests(llm, prompts[1:], params)
    rest_ms = [1e3 * t for t in rest["ttft_s"]]
    wall_s = first["wall_s"] + rest["wall_s"]
    output_tokens = sum(len(ids) for run in (first, rest) for ids in run["token_ids"])
    prompt_tokens = sum(len(p) for p in prompts)
    return {"first_ttft_ms": 1e3 * first["ttft_s"][0],
            "rest_ttft_ms_median": statistics.median(rest_ms), "rest_ttft_ms": rest_ms,
            "first_cached_tokens": first["cached_tokens"][0],
            "rest_cached_tokens": rest["cached_tokens"], "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "wall_s": wall_s,
            "output_tok_s": output_tokens / wall_s,
            "total_tok_s": (prompt_tokens + output_tokens) / wall_s}


def chat_run(llm, messages: list[list[int]], params: SamplingParams) -> dict:
    history, turns, wall_s, output_tokens = [], [], 0.0, 0
    for number, message in enumerate(messages, start=1):
        prompt = history + message
        run = timed_requests(llm, [prompt], params)
        reply = run["token_ids"][0]
        history = prompt + reply
        wall_s += run["wall_s"]
        output_tokens += len(reply)
        turns.append({"turn": number, "prompt_tokens": len(prompt),
                      "cached_tokens": run["cached_tokens"][0],
                      "ttft_ms": 1e3 * run["ttft_s"][0]})
    return {"turns": turns, "turn1_ttft_ms": turns[0]["ttft_ms"],
            "last_turn_ttft_ms": turns[-1]["ttft_ms"],
            "last_over_first_ttft": turns[-1]["ttft_ms"] / turns[0]["ttft_ms"],
            "output_tokens": output_tokens, "wall_s": wall_s,
            "output_tok_s": output_tokens / wall_s}


def run_prefix(llm, settings: BenchSettings, device, log) -> dict:
    """Both workloads with prefix caching on, then off, on the same engine; the cache is
    emptied before each run (and the setting put back after)."""
    top = max_token_id(llm)
    work = prefix_workload(settings, top)
    new_tokens = SamplingParams(temperature=0, max_tokens=settings.scaled(PREFIX_NEW_TOKENS),
                                ignore_eos=True)
    reply = SamplingParams(temperature=0, max_tokens=settings.scaled(CHAT_REPLY), ignore_eos=True)
    longest = max(len(p) for p in work["prompts"]) + new_tokens.max_tokens
    suffix_tokens = len(work["prompts"][0]) - work["shared_tokens"]
    chat_tokens = CHAT_TURNS * (len(work["messages"][0]) + reply.max_tokens)
    if max(longest, chat_tokens) > llm.context_limit:
        raise OptionError(f"bench prefix needs a context of {max(longest, chat_tokens)} "
                          f"tokens but the engine has {llm.context_limit}; raise "
                          f"--max-model-len or lower --scale")
    result = {"requests": PREFIX_REQUESTS, "shared_tokens": work["shared_tokens"],
              "suffix_tokens": suffix_tokens, "new_tokens": new_tokens.max_tokens,
              "chat_turns": CHAT_TURNS, "chat_message_tokens": len(work["messages"][0]),
              "chat_reply_tokens": reply.max_tokens}
    engine = llm.engine
    was_enabled = engine.engine_config.enable_prefix_caching
    try:
        # the first use of these step shapes, untimed, on other ids: a whole prompt alone,
        # then the suffixes together
        started = time.perf_counter()
        engine.set_prefix_caching(False)
        rng = random.Random(settings.seed + 2)
        timed_requests(llm, [random_ids(rng, len(work["prompts"][0]), top)], new_tokens)
        timed_requests(llm, [random_ids(rng, suffix_tokens, top) for _ in work["prompts"][1:]],
                       new_tokens)
        result["warmup_s"] = time.perf_counter() - started
        for label, enabled in (("cached", True), ("uncached", False)):
            engine.reset_prefix_cache()
            engine.set_prefix_caching(enabled)
            before = engine.stats()
            run = {"shared_prefix": shared_prefix_run(llm, work["prompts"], new_tokens),
                   "chat": chat_run(llm, work["messages"], reply)}
            after = engine.stats()
            queried = after.prefix_cache_queries - before.prefix_cache_queries
            hits = after.prefix_cache_hits - before.prefix_cache_hits
            run["hit_rate"] = hits / queried if queried else 0.0
            result[label] = run
            shared, chat = run["shared_prefix"], run["chat"]
            log(f"prefix, caching {'on' if enabled else 'off'}: shared prefix: first TTFT "
                f"{shared['first_ttft_ms']:.2f} ms, the rest {shared['rest_ttft_ms_median']:.2f} "
                f"ms (median), {shared['output_tok_s']:,.0f} output tok/s; chat: turn 1 TTFT "
                f"{chat['turn1_ttft_ms']:.2f} ms, turn {CHAT_TURNS} {chat['last_turn_ttft_ms']:.2f} "
                f"ms; prompt tokens from the cache {100 * run['hit_rate']:.0f}%")
    finally:
        engine.reset_prefix_cache()
        engine.set_prefix_caching(was_enabled)
    on, off = result["cached"], result["uncached"]
    result["rest_ttft_on_over_off"] = (on["shared_prefix"]["rest_ttft_ms_median"]
                                       / off["shared_prefix"]["rest_ttft_ms_median"])
    result["last_turn_ttft_on_over_off"] = (on["chat"]["last_turn_ttft_ms"]
                                            / off["chat"]["last_turn_ttft_ms"])
    return result


OUR_MODES = {"throughput": run_throughput, "latency": run_latency, "ttft": run_ttft,
             "decode-sweep": run_decode_sweep, "prefix": run_prefix}


# ---- the device: memory and bandwidth -----------------------------------------------------

class DeviceProbe:
    """What the report needs from the device: its name, memory in use, copy bandwidth."""

    def __init__(self, kind: str):
        self.kind = kind
        self._bandwidth = None
        if kind == "cuda":
            from ..backends.cuda.device import check_cuda_device, device_name, import_cupy
            check_cuda_device()
            self.cupy = import_cupy()
            self.name = device_name(self.cupy.cuda.Device())
        else:
            self.cupy = None
            self.name = platform.processor() or platform.machine() or "cpu"

    def used_bytes(self) -> int | None:
        """Device memory in use by every process (cudaMemGetInfo); None on the CPU."""
        if self.cupy is None:
            return None
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(total - free)

    def total_bytes(self) -> int | None:
        return None if self.cupy is None else int(self.cupy.cuda.runtime.memGetInfo()[1])

    def copy_bandwidth(self) -> float:
        """Bytes moved per second (read + write) by a large device-to-device copy, measured
        once per run; on the GPU only."""
        if self.cupy is None:
            raise RuntimeError("the CPU has no copy bandwidth that bounds its reads")
        if self._bandwidth is None:
            self._bandwidth = self._cuda_copy()
        return self._bandwidth

    def _cuda_copy(self, repeats: int = 20) -> float:
        cupy = self.cupy
        nbytes = min(COPY_BYTES, cupy.cuda.runtime.memGetInfo()[0] // 4)
        src = cupy.ones(nbytes, np.uint8)
        dst = cupy.empty_like(src)
        for _ in range(3):
            dst.data.copy_from_device_async(src.data, nbytes)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            dst.data.copy_from_device_async(src.data, nbytes)
        end.record()
        end.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, end) / 1e3
        del src, dst
        cupy.get_default_memory_pool().free_all_blocks()
        return 2 * nbytes * repeats / seconds


def memory_report(llm, device: DeviceProbe, used: dict) -> dict:
    """Where the memory went: the backend's own plan, beside what the device reports."""
    plan = [{"name": n, "bytes": int(b), "note": note} for n, b, note in llm.backend.memory_plan()]
    report = {"plan": plan, "planned_bytes": sum(row["bytes"] for row in plan),
              **{f"{k}_bytes": v for k, v in used.items()}}
    if device.cupy is not None:
        pool = device.cupy.get_default_memory_pool()
        report["device_total_bytes"] = device.total_bytes()
        report["cupy_pool_held_bytes"] = int(pool.total_bytes())
        report["cupy_pool_used_bytes"] = int(pool.used_bytes())
        # what the plan does not name: CUDA graphs, cuBLAS workspace, kernel images, pool slack
        report["unplanned_bytes"] = (used["peak_used"] - used["used_before_load"]
                                     - report["planned_bytes"])
        report["note"] = ("peak_used: the most device memory in use after load, warm-up and each "
                          "mode (cudaMemGetInfo, all processes); the memory pool keeps what it "
                          "grows to, so this is the run's peak")
    else:
        import resource
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def release(llm, device: DeviceProbe) -> None:
    """Frees cupy-llama's GPU memory so transformers runs with the whole device."""
    llm.close()
    gc.collect()
    if device.cupy is not None:
        device.cupy.get_default_memory_pool().free_all_blocks()


def describe_model(llm, model_dir: Path, settings: BenchSettings, made_s) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return {"dir": str(model_dir), "random_preset": None if settings.model_dir else settings.preset,
            "random_seed": None if settings.model_dir else MODEL_SEED, "written_s": made_s,
            "num_parameters": llm.config.num_parameters, "config": config}


def bench_command(mode: str, *, model_dir, device, preset, json_path, hf, seed, num_requests,
                  scale, batch_sizes: str, commit, engine: dict, out=print,
                  resolve_device=None) -> dict:
    """The `cupy-llama bench` command: parse, run, print the table.
    resolve_device(device, engine) -> (cuda or cpu, the engine options that device
    takes), called once the settings are checked; needed for device "auto"."""
    try:
        sizes = tuple(int(part) for part in batch_sizes.split(","))  # "" and "1,,2" refused
    except ValueError:
        raise OptionError(f"--batch-sizes must be comma-separated integers, "
                           f"got {batch_sizes!r}") from None
    settings = BenchSettings(mode=mode, model_dir=model_dir, preset=preset, device=device,
                             seed=seed, num_requests=num_requests, scale=scale,
                             batch_sizes=sizes, hf=hf, json_path=json_path, commit=commit,
                             engine=engine)
    if resolve_device is not None:
        device, engine = resolve_device(settings.device, settings.engine)
        settings = replace(settings, device=device, engine=engine)
    if settings.device == "auto":
        raise ValueError("bench_command needs resolve_device for device 'auto'")
    report = run_bench(settings)
    out(format_table(report))
    return report

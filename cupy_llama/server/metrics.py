"""Prometheus metrics of the server, named as vLLM names its own with `cupy_llama:` in
front of `vllm:` and with vLLM's label names, so dashboards made for one read the other.

The engine's state (running and waiting requests, KV-cache use, preemptions, steps, prefix
cache, tokens per step) is read from the engine process's latest report when /metrics is
scraped. The request metrics are counted when a request's choice finishes, for every
request, streamed or not, as vLLM counts them: its tokens, and its times from the engine
process's clock (when the engine took the request, first scheduled it, and had its first
and last token) against the server's (when the request arrived, and ended). No `_created`
series: vLLM's dashboards read none.
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from ..engine.async_engine import ITERATION_TOKEN_BUCKETS

prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# vLLM's request-time buckets (e2e, queue, prefill, decode, inference)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                       50000, 100000)  # vLLM's 1-2-5 series
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector:
    """The engine process's last report, as gauges, counters and the tokens-per-step
    histogram at scrape time."""

    def __init__(self, engine_state, model_name: str):
        # () -> (stats dict, requests waiting, tokens generated)
        self.engine_state = engine_state
        self.model_name = model_name

    def collect(self):
        stats, num_waiting, generated = self.engine_state()
        label = [self.model_name]

        def family(kind, name, documentation, value):
            metric = kind(f"cupy_llama:{name}", documentation, labels=["model_name"])
            metric.add_metric(label, value)
            return metric

        num_blocks = stats.get("num_blocks", 0)  # EngineStats' fields, and the loop's own
        used = 1 - stats.get("num_free_blocks", 0) / num_blocks if num_blocks else 0.0
        yield family(GaugeMetricFamily, "num_requests_running",
                     "Sequences the engine is running, prefill or decode (a request of n "
                     "samples has n).", stats.get("num_running", 0))
        yield family(GaugeMetricFamily, "num_requests_waiting",
                     "Sequences waiting for the engine to admit them.", num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_usage_perc",
                     "Fraction of KV-cache blocks in use (1 means all).", used)
        yield family(CounterMetricFamily, "num_preemptions",
                     "Sequences preempted (their KV dropped, recomputed later).",
                     stats.get("num_preemptions", 0))
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        yield family(CounterMetricFamily, "prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache (each sample's, at its first "
                     "admission).", queries)
        yield family(CounterMetricFamily, "prefix_cache_hits",
                     "Prompt tokens the prefix cache held (of prefix_cache_queries).", hits)
        yield family(GaugeMetricFamily, "prefix_cache_hit_rate",
                     "prefix_cache_hits / prefix_cache_queries since the server started.",
                     hits / queries if queries else 0.0)
        yield family(CounterMetricFamily, "generation_tokens", "Tokens generated (of requests "
                     "whose client went away too).", generated)
        yield family(CounterMetricFamily, "engine_steps", "Engine steps taken.",
                     stats.get("num_steps", 0))
        yield family(CounterMetricFamily, "engine_step_seconds",
                     "Time inside LLMEngine.step(): host work, and on a GPU the wait for the "
                     "previous step's tokens (divide by engine_steps: time per step).",
                     stats.get("step_seconds", 0.0))
        yield family(CounterMetricFamily, "engine_loop_seconds",
                     "Time of the engine loop's turns that stepped: the step plus taking "
                     "requests and sending outputs (minus engine_step_seconds: what the "
                     "server costs the engine).", stats.get("loop_seconds", 0.0))
        counts = stats.get("iteration_tokens", [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram = HistogramMetricFamily("cupy_llama:iteration_tokens_total",
                                          "Tokens computed per engine step (prefill and "
                                          "decode).", labels=["model_name"])
        histogram.add_metric(label, buckets, stats.get("iteration_tokens_sum", 0))
        yield histogram


class Metrics:
    def __init__(self, engine_state, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_state, model_name))
        self.model_name = model_name
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def counter(name, documentation):
            return Counter(f"cupy_llama:{name}", documentation, **labels).labels(model_name)

        def histogram(name, documentation, buckets):
            return Histogram(f"cupy_llama:{name}", documentation, buckets=buckets,
                             **labels).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        success = Counter("cupy_llama:request_success", "Requests finished, by finish reason "
                          "(abort: the client went away, or the server stopped it).",
                          labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From a request's arrival to its first token.",
            TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, "
            "per request.", TPOT_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From a request's arrival to its end.",
            REQUEST_TIME_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "From the engine taking a request to its first "
            "scheduling.", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "From a request's first scheduling to its first "
            "token.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds", "From a request's first token to its last.",
            REQUEST_TIME_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "From a request's first scheduling to its last "
            "token (prefill and decode).", REQUEST_TIME_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS)
        self.request_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each request.",
            TOKEN_COUNT_BUCKETS)
        self.request_n = histogram("request_params_n", "The n of each request.", N_BUCKETS)
        self._cache_config = Gauge("cupy_llama:cache_config_info", "The KV cache's "
                                   "configuration, in its labels.",
                                   labelnames=["block_size", "num_gpu_blocks",
                                               "enable_prefix_caching"],
                                   registry=self.registry)

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self._cache_config.labels(str(block_size), str(num_blocks),
                                  str(bool(prefix_caching))).set(1)

    def request_params(self, max_tokens: int, n: int) -> None:
        """A request (one prompt's) taken in."""
        self.request_max_tokens.observe(max_tokens)
        self.request_n.observe(n)

    def request_finished(self, finish_reason: str, num_prompt_tokens: int,
                         num_generated: int, arrival: float, times, now: float) -> None:
        """A choice ended. arrival and now: the server's time.monotonic() when the request
        came and now; times: the engine's (taken in, first scheduled, first token, last
        token), each None where it never came to that (time.monotonic() is one clock for
        every process of a machine)."""
        self._success[finish_reason].inc()
        self.e2e_request_latency.observe(now - arrival)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        if times is None:
            return
        taken, scheduled, first_token, last_token = times
        if scheduled is not None:
            self.queue_time.observe(scheduled - taken)
        if first_token is None:
            return
        self.time_to_first_token.observe(first_token - arrival)
        if scheduled is not None:
            self.prefill_time.observe(first_token - scheduled)
            self.inference_time.observe(last_token - scheduled)
        self.decode_time.observe(last_token - first_token)
        if num_generated > 1:
            self.time_per_output_token.observe((last_token - first_token) / (num_generated - 1))

    def request_aborted(self) -> None:
        """A choice ended without the engine's word (its client went away)."""
        self._success["abort"].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

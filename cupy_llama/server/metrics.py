"""Prometheus metrics of the server, named as vLLM names its own with `cupy_llama:` in
front of `vllm:`, so dashboards made for one read the other.

The engine's state (running and waiting requests, KV-cache use, preemptions, steps) is
read from the engine process's latest report when /metrics is scraped; the request
metrics (tokens, latencies, finish reasons) are counted where the server sees them.
Latencies are measured as a client sees them: from the request's arrival to the moment
its handler writes the tokens, for streamed requests (a request that is not streamed
gets its tokens all at once: only its end-to-end latency is recorded).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineCollector:
    """The engine process's last report, as gauges and counters at scrape time."""

    def __init__(self, engine_state, model_name: str):
        self.engine_state = engine_state  # () -> (stats dict, requests waiting)
        self.model_name = model_name

    def collect(self):
        stats, num_waiting = self.engine_state()
        label = [self.model_name]

        def family(kind, name, documentation, value):
            metric = kind(f"cupy_llama:{name}", documentation, labels=["model_name"])
            metric.add_metric(label, value)
            return metric

        num_blocks = stats.get("num_blocks", 0)  # EngineStats' fields, and the loop's times
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


class Metrics:
    def __init__(self, engine_state, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_state, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def counter(name, documentation):
            return Counter(f"cupy_llama:{name}", documentation, **labels).labels(model_name)

        def histogram(name, documentation, buckets):
            return Histogram(f"cupy_llama:{name}", documentation, buckets=buckets,
                             **labels).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter("cupy_llama:request_success", "Requests finished, by finish "
                                "reason (abort: the client went away).",
                                labelnames=["model_name", "finished_reason"],
                                registry=self.registry)
        self._success_by_reason = {reason: self._success.labels(model_name, reason)
                                   for reason in ("stop", "length", "abort")}
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to the first token of streamed requests.",
            TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, "
            "per streamed request.", TPOT_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from a request's arrival to its end.",
            E2E_BUCKETS)

    def request_finished(self, finish_reason: str) -> None:
        self._success_by_reason[finish_reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

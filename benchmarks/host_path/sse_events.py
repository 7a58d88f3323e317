"""The server process's SSE events of one decode step of 256 streamed completions and of
256 streamed chat completions (one token's text each), built as chunks() dicts and
encoded, against text_event; median us a step of 200 steps, each way in turn, five rounds
(NOTES, "Streamed text chunks encoded around their text"). Then chat completions under a
reasoning parser (Qwen3's markers), whose chunks are always built. From the checkout's root, so
that it times this checkout's server code:

    PYTHONPATH=. python3 benchmarks/host_path/sse_events.py
"""
import statistics
import time

from cupy_llama.reasoning import ReasoningParser, reasoning_format
from cupy_llama.server import protocol
from cupy_llama.server.protocol import ChatCompletionRequest, CompletionRequest, parse

CHOICES = 256
PIECES = [" the", " model", ",", " é", "\n", ' "', " 12", "ing"]  # a step's token texts


def step_built(stream) -> bytes:
    return b"".join(protocol.sse_event(chunk) for i in range(CHOICES)
                    for chunk in stream.chunks(i, PIECES[i % len(PIECES)], [5], None, None))


def step_events(stream) -> bytes:
    return b"".join(stream.text_event(i, PIECES[i % len(PIECES)], None, None)
                    for i in range(CHOICES))


def median_us(fn, stream, steps: int = 200) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn(stream)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    completions = protocol.CompletionStream(
        parse(CompletionRequest, {"prompt": "x", "stream": True}), "cmpl-" + "0" * 32,
        1733400000, "llama-3.2-1b", None, "fp_0123456789")
    chat = protocol.ChatCompletionStream(
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                      "stream": True}),
        "chatcmpl-" + "0" * 32, 1733400000, "llama-3.2-1b", None, "fp_0123456789")
    for i in range(CHOICES):
        chat.chunks(i, "", [], None, None)  # each choice's opening chunk
    for name, stream in (("completions", completions), ("chat", chat)):
        assert step_built(stream) == step_events(stream)
        for round_ in range(5):
            built, events = median_us(step_built, stream), median_us(step_events, stream)
            print(f"{name} round {round_ + 1}: chunks() and encoded {built:.0f} us a step, "
                  f"text_event {events:.0f} us")
    thinking = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                             "stream": True})
    # end and start token ids that no step's token (5) is
    thinking.set_reasoning_parser(ReasoningParser(reasoning_format("qwen3"), 2, 1, False,
                                                  frozenset(), lambda ids: "t" * len(ids)))
    split = protocol.ChatCompletionStream(thinking, "chatcmpl-" + "0" * 32, 1733400000,
                                          "qwen3-0.6b", None, "fp_0123456789")
    for i in range(CHOICES):
        split.chunks(i, "", [], None, None)
    for round_ in range(5):
        print(f"chat, reasoning parser round {round_ + 1}: chunks() and encoded "
              f"{median_us(step_built, split):.0f} us a step")


if __name__ == "__main__":
    main()

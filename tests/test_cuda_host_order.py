"""The host side of the CUDA backend's stream and event ordering, checked without a GPU:
a fake cupy logs every stream operation, host wait and host write of a watched buffer in
the order the code issues them, and `ordered` reads off that log what CUDA guarantees to
be over before what (stream order, waits and synchronizes on an event's latest record).
Copies are done at once, so the data tests also see which buffer each step used."""
import ctypes
import sys
import types
from collections import namedtuple
from dataclasses import replace

import numpy as np
import pytest

from cupy_llama.interface import KERNEL_ROWS, ForwardBatch, SamplingTensors
from cupy_llama.backends.cuda import graphs, ops
from cupy_llama.backends.cuda import sampling as sampling_kernels
from cupy_llama.backends.cuda.switches import KernelSwitches

Op = namedtuple("Op", "who what detail")  # who: a stream's name or "host"
H2D, D2H = ops.H2D, ops.D2H


class DeviceArray(np.ndarray):
    """A fake device array: host memory whose address stands in for the device pointer."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.name = cuda, "event"  # the test names the events it checks

    def record(self, stream=None):
        self.cuda.add(Op((stream or self.cuda.current).name, "record", self.name))

    def synchronize(self):
        self.cuda.add(Op("host", "sync", self.name))


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name, self.ptr = cuda, name, id(self)
        cuda.streams[self.ptr] = self

    def wait_event(self, event):
        self.cuda.add(Op(self.name, "wait", event.name))


class FakeCuda:
    """cupy.cuda as far as sample_async and _stage use it."""

    def __init__(self):
        self.log, self.names, self.watched, self.streams = [], {}, {}, {}
        self.current = FakeStream(self, "step")  # the caller's stream
        self.runtime = types.SimpleNamespace(memcpyAsync=self.memcpy_async)
        self.alloc_pinned_memory = bytearray

    def Stream(self, non_blocking=False):
        return FakeStream(self, "copy")  # CudaOps's copy stream (DecodeGraphs: never used)

    def Event(self, disable_timing=False):
        return FakeEvent(self)

    def get_current_stream(self):
        return self.current

    def name(self, array, name):
        self.names[array.ctypes.data] = name

    def watch(self, array, name):
        self.watched[name] = (array, array.tobytes())

    def add(self, op):
        # a host write shows up before the first logged operation that follows it
        for name, (array, seen) in self.watched.items():
            if array.tobytes() != seen:
                self.log.append(Op("host", "write", name))
                self.watch(array, name)
        self.log.append(op)

    def memcpy_async(self, dst, src, nbytes, kind, stream_ptr):
        ctypes.memmove(dst, src, nbytes)
        direction = {H2D: "H2D", D2H: "D2H"}[kind]
        names = (self.names.get(src, hex(src)), self.names.get(dst, hex(dst)), nbytes)
        self.add(Op(self.streams[stream_ptr].name, direction, names))


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    cupy.empty = cupy.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(DeviceArray)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cuda


def ordered(log, first, then):
    """Whether CUDA has finished log[first] before log[then] starts."""
    seen, todo = set(), [then]
    while todo:
        i = todo.pop()
        if i == first:
            return True
        if i not in seen:
            seen.add(i)
            who, what, detail = log[i]
            todo += [j for j in range(i) if log[j].who == who][-1:]  # stream or host order
            if what in ("wait", "sync"):  # waits for the event's latest record
                todo += [j for j in range(i)
                         if log[j].what == "record" and log[j].detail == detail][-1:]
    return False


# ---- CudaOps.sample_async and PendingTokens ---------------------------------------------
ROWS, MAX_SEQS, STEPS = 3, 4, 5


def settings(step):
    """Sampling settings of one step; `steps` differs each step (the fake kernel returns it)."""
    return SamplingTensors(
        temperature=np.ones(ROWS, np.float32), top_k=np.zeros(ROWS, np.int32),
        top_p=np.ones(ROWS, np.float32), min_p=np.zeros(ROWS, np.float32),
        seeds=np.full(ROWS, 7, np.uint64), steps=np.arange(ROWS, dtype=np.int32) + 10 * step)


@pytest.fixture
def pipelined(fake, monkeypatch):
    """STEPS + 1 sampling steps driven as LLMEngine.step does: launch step k + 1, then read
    step k's tokens. Returns the log and, per read, (tokens, index of its last log entry)."""
    def fake_sample(logits, settings, capacity, out_tokens, counts=None):
        fake.add(Op(fake.current.name, "kernel", "sample"))
        # reads the settings that reached the device buffer
        out_tokens[:] = sampling_kernels.settings_views(settings, capacity)["steps"][:len(out_tokens)]

    monkeypatch.setattr(sampling_kernels, "sample_settings", fake_sample)
    monkeypatch.setattr(ops, "device_limits", lambda: {"sms": 132})  # the real __init__ else
    no_launch_attributes = KernelSwitches(programmatic=False, clusters=False)  # no device query
    cuda_ops = ops.CudaOps(max_num_tokens=8, max_num_seqs=MAX_SEQS, max_blocks_per_seq=4,
                           num_heads=2, head_dim=64, max_model_len=64,
                           switches=no_launch_attributes)
    fake.name(cuda_ops._sampling_host, "settings_host")
    fake.name(cuda_ops._sampling_device, "settings_device")
    fake.name(cuda_ops._tokens_device, "tokens_device")
    for turn in (0, 1):
        fake.name(cuda_ops._tokens_host[turn], f"tokens_host{turn}")
        cuda_ops._token_copies[turn].name = f"tokens{turn}"
    cuda_ops._sampling_copied.name, cuda_ops._sampled.name = "settings_copied", "sampled"
    fake.watch(cuda_ops._sampling_host, "settings")
    logits = np.zeros((ROWS, 16), np.float32)
    pending, reads = cuda_ops.sample_async(logits, settings(0)), []
    for step in range(1, STEPS + 1):
        following = cuda_ops.sample_async(logits, settings(step))
        reads.append((pending.get(), len(fake.log) - 1))
        pending = following
    return fake.log, reads


def entries(log, what):
    """Log indices of one kind of entry, one per step."""
    found = [i for i, op in enumerate(log) if op.what == what]
    assert len(found) == STEPS + 1, what
    return found


def test_settings_copy_kernel_and_token_copy_are_ordered_across_streams(pipelined):
    log, _ = pipelined
    copies, kernels, backs = (entries(log, what) for what in ("H2D", "kernel", "D2H"))
    for step, (copy, kernel, back) in enumerate(zip(copies, kernels, backs)):
        assert (log[copy].who, log[kernel].who, log[back].who) == ("copy", "step", "copy")
        # per sequence: each kernel row of SAMPLING_ROWS and a row that asks for logprobs
        per_seq = sum(np.dtype(row.dtype).itemsize for row in KERNEL_ROWS) + 4
        assert log[copy].detail == ("settings_host", "settings_device", per_seq * MAX_SEQS)
        if step:
            # the one device settings buffer is overwritten only after the last kernel that
            # read it: behind the last token copy, which waited for that kernel
            assert ordered(log, backs[step - 1], copy)
            assert ordered(log, kernels[step - 1], backs[step - 1])
            # and the kernel overwrites the device tokens only once they were copied back
            # (through the settings copy queued behind that copy)
            assert ordered(log, backs[step - 1], kernel)
        assert ordered(log, copy, kernel)  # the kernel reads this step's settings
        assert ordered(log, kernel, back)  # and the copy back its tokens
    # one cross-stream wait per step on the step stream: the settings copy implies the rest
    assert [op.detail for op in log if op.who == "step" and op.what == "wait"] == \
        ["settings_copied"] * (STEPS + 1)


def test_token_copies_alternate_and_each_read_waits_for_its_own(pipelined):
    log, reads = pipelined
    backs = entries(log, "D2H")
    for step, (back, (tokens, read)) in enumerate(zip(backs, reads)):
        assert log[back].detail == ("tokens_device", f"tokens_host{step % 2}", 4 * ROWS)
        # the read synchronizes the event recorded after its own copy, not the other one
        assert log[read] == Op("host", "sync", f"tokens{step % 2}")
        assert ordered(log, back, read)
        # step + 1 was launched before this read: its tokens went to the other buffer
        np.testing.assert_array_equal(tokens, settings(step).steps)


def test_host_writes_the_settings_buffer_after_its_last_copy(pipelined):
    log, _ = pipelined
    copies, writes = entries(log, "H2D"), entries(log, "write")
    for step, (copy, write) in enumerate(zip(copies, writes)):
        assert write < copy and log[write] == Op("host", "write", "settings")
        if step:
            assert ordered(log, copies[step - 1], write)


def test_slot_state_is_made_and_applied_on_the_step_stream_before_the_sampling_kernel(
        fake, monkeypatch):
    """A step with penalties: the reset kernel (which reads the last step's tokens on the
    device) and the processing kernel run on the step stream after the settings copy and
    before this step's sampling kernel, which overwrites those tokens and counts the kept
    ones into the same state."""
    from cupy_llama.interface import SlotReset
    seen = {}

    def fake_reset(state, resets, last_sampled):
        fake.add(Op(fake.current.name, "kernel", "reset"))
        seen["reset"] = (state, [r.slot for r in resets or ()], last_sampled.copy())

    def fake_process(logits, settings, capacity, state):
        fake.add(Op(fake.current.name, "kernel", "process"))
        seen["process_slots"] = sampling_kernels.settings_views(settings, capacity)[
            "state_slot"][:len(logits)].copy()

    def fake_sample(logits, settings, capacity, out_tokens, counts=None):
        fake.add(Op(fake.current.name, "kernel", "sample"))
        seen["counts"] = counts
        out_tokens[:] = 5

    monkeypatch.setattr(sampling_kernels, "reset_state", fake_reset)
    monkeypatch.setattr(sampling_kernels, "process_logits", fake_process)
    monkeypatch.setattr(sampling_kernels, "sample_settings", fake_sample)
    monkeypatch.setattr(ops, "device_limits", lambda: {"sms": 132})
    cuda_ops = ops.CudaOps(max_num_tokens=8, max_num_seqs=MAX_SEQS, max_blocks_per_seq=4,
                           num_heads=2, head_dim=64, max_model_len=64,
                           switches=KernelSwitches(programmatic=False, clusters=False))
    cuda_ops._sampling_copied.name = "settings_copied"
    logits = np.zeros((ROWS, 16), np.float32)
    cuda_ops.sample_async(logits, settings(0)).get()  # a plain step: no state kernels
    assert seen == {"counts": None} and cuda_ops._slot_state is None
    penalized = settings(1)
    penalized.state_slot = np.array([2, -1, 0], np.int32)
    penalized.count_token = np.array([1, 0, 1], np.int32)
    penalized.repetition_penalty = np.array([1.2, 1.0, 1.0], np.float32)
    penalized.resets = [SlotReset(2, [1, 2], [-1], [], [])]
    start = len(fake.log)
    cuda_ops.sample_async(logits, penalized).get()
    log = fake.log
    kernels = [i for i in range(start, len(log)) if log[i].what == "kernel"]
    assert [log[i].detail for i in kernels] == ["reset", "process", "sample"]
    assert all(log[i].who == "step" for i in kernels)
    copy = next(i for i in range(start, len(log)) if log[i].what == "H2D")
    assert ordered(log, copy, kernels[0])  # the reset and processing read this step's settings
    state, slots, last_sampled = seen["reset"]
    assert slots == [2] and state is cuda_ops._slot_state
    np.testing.assert_array_equal(last_sampled[:ROWS], [5] * ROWS)  # the last step's tokens
    np.testing.assert_array_equal(seen["process_slots"], [2, -1, 0])
    assert seen["counts"] is state.counts and state.counts.shape == (MAX_SEQS, 16)


# ---- structured outputs: deferred rows drawn by CudaOps.sample_masked ------------------------
DEFERRED_ROW = 1


def test_deferred_rows_are_drawn_before_the_token_copy_and_their_buffers_reused_safely(
        fake, monkeypatch):
    """Each step deferring one row, driven as LLMEngine.step does (launch step k + 1, read
    step k's tokens, then draw step k + 1's deferred row): the first launch skips the row,
    the masked launch waits for its mask copies and writes it, the token copy follows the
    masked launch, and the host rewrites the bitmask buffer only after its last copy."""
    def fake_sample(logits, settings, capacity, out_tokens, counts=None, bitmask=None,
                    mask_rows=None):
        fake.add(Op(fake.current.name, "kernel", "masked" if bitmask is not None else "plain"))
        steps = np.asarray(sampling_kernels.settings_views(settings, capacity)["steps"])
        rows = np.asarray(mask_rows)
        drawn = rows != sampling_kernels.MASK_SKIP
        out_tokens[drawn] = steps[:len(rows)][drawn] + 1000 * (rows[drawn] >= 0)

    monkeypatch.setattr(sampling_kernels, "sample_settings", fake_sample)
    monkeypatch.setattr(ops, "device_limits", lambda: {"sms": 132})
    cuda_ops = ops.CudaOps(max_num_tokens=8, max_num_seqs=MAX_SEQS, max_blocks_per_seq=4,
                           num_heads=2, head_dim=64, max_model_len=64,
                           switches=KernelSwitches(programmatic=False, clusters=False))
    fake.name(cuda_ops._tokens_device, "tokens_device")
    for turn in (0, 1):
        cuda_ops._token_copies[turn].name = f"tokens{turn}"
    cuda_ops._sampling_copied.name, cuda_ops._sampled.name = "settings_copied", "sampled"
    cuda_ops._masks_copied.name = "masks_copied"
    logits = np.zeros((ROWS, 16), np.float32)
    deferred = np.arange(ROWS) == DEFERRED_ROW

    def launch(step):
        return cuda_ops.sample_async(logits, replace(settings(step), deferred=deferred))

    def draw(pending, step):
        bitmask = np.full((MAX_SEQS, 1), step, np.uint32)
        cuda_ops.sample_masked(pending, [DEFERRED_ROW], bitmask)
        if step == 0:  # the buffers exist from the first draw on
            fake.name(cuda_ops._bitmask_host, "bitmask_host")
            fake.watch(cuda_ops._bitmask_host, "bitmask")

    pending = launch(0)
    draw(pending, 0)
    for step in range(1, STEPS + 1):
        following = launch(step)
        tokens = pending.get()
        np.testing.assert_array_equal(
            tokens, settings(step - 1).steps + 1000 * deferred)  # the row: the masked draw's
        draw(following, step)
        pending = following
    log = fake.log
    plain = [i for i, op in enumerate(log) if op.detail == "plain"]
    masked = [i for i, op in enumerate(log) if op.detail == "masked"]
    backs = [i for i, op in enumerate(log) if op.what == "D2H" and op.detail[0] == "tokens_device"]
    bitmask_copies = [i for i, op in enumerate(log)
                      if op.what == "H2D" and op.detail[0] == "bitmask_host"]
    writes = [i for i, op in enumerate(log) if op == Op("host", "write", "bitmask")]
    assert len(plain) == len(masked) == len(backs) == STEPS + 1
    for step in range(STEPS + 1):
        assert ordered(log, plain[step], masked[step])
        assert ordered(log, masked[step], backs[step])  # the copy holds the masked token
        if step:
            assert ordered(log, masked[step - 1], plain[step])
    # (named from the first draw on: entry i is step i + 1's)
    assert len(bitmask_copies) == len(writes) == STEPS
    for i, copy in enumerate(bitmask_copies):
        assert ordered(log, copy, masked[i + 1])  # the masked kernel reads this step's mask
        if i:  # the host wrote this step's mask only after the last one was copied
            assert ordered(log, bitmask_copies[i - 1], writes[i])


# ---- DecodeGraphs._stage and run -----------------------------------------------------------
def decode_batch(token_ids, seq_lens, block_tables):
    num_seqs = len(token_ids)
    return ForwardBatch(
        token_ids=np.array(token_ids, np.int32), positions=np.array(seq_lens, np.int32) - 1,
        slot_mapping=np.array(token_ids, np.int32) * 10,
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
        seq_lens=np.array(seq_lens, np.int32), block_tables=np.array(block_tables, np.int32),
        max_query_len=1, max_seq_len=max(seq_lens))


def decode_graphs(fake, width: int, bucket: int) -> graphs.DecodeGraphs:
    """The real __init__ on the fake cupy (the backend is only what it reads), its events
    and streams named and its host buffer watched."""
    config = types.SimpleNamespace(head_dim=64, num_attention_heads=4, num_key_value_heads=1)
    backend = types.SimpleNamespace(
        max_num_seqs=bucket, max_model_len=64, config=config,
        ops=types.SimpleNamespace(max_blocks_per_seq=width, decode_clusters=lambda *_: False))
    decode = graphs.DecodeGraphs(backend)
    decode._copied.name, decode._replayed.name = "copied", "replayed"
    decode._stage_stream.name, decode._capture_stream.name = "stage", "capture"
    fake.watch(decode._host, "meta")
    return decode


def test_stage_writes_a_batch_own_columns_pads_its_rows_and_copies_only_them(fake):
    width, bucket = 5, 4
    decode = decode_graphs(fake, width, bucket)
    fake.name(decode._host, "meta_host")
    fake.name(decode._device, "meta_device")
    tables_at = decode.layout.offsets["block_tables"]

    decode._stage(decode_batch([11, 12], [6, 7], [[1, 2, 3], [4, 5, 6]]), bucket)
    decode._stage(decode_batch([21], [9], [[7, 8]]), bucket)

    host = {name: decode._field(name, bucket) for name in
            ("token_ids", "positions", "slot_mapping", "seq_lens")}
    assert host["token_ids"].tolist() == [21, 0, 0, 0]  # rows past the batch: padding
    assert host["positions"].tolist() == [8, 0, 0, 0]
    assert host["slot_mapping"].tolist() == [210, -1, -1, -1]  # -1: no KV write
    assert host["seq_lens"].tolist() == [9, 0, 0, 0]  # 0: attention reads no block
    # the batch's table, on the host and on the device (past a row's length nothing is
    # read, whatever an earlier step left there)
    tables = decode._host[tables_at:].reshape(bucket, width)
    device = decode._device[tables_at:].reshape(bucket, width)
    assert tables[0, :2].tolist() == device[0, :2].tolist() == [7, 8]
    # only the batch's rows are copied: rows 2 and 3 never reached the device
    assert device[2:].tolist() == [[0] * width] * 2
    # the host buffer is written only once the previous copy has read it, and each copy
    # is recorded on the caller's stream
    def staged(num_seqs):
        nbytes = 4 * (tables_at + num_seqs * width)
        return [Op("host", "sync", "copied"), Op("host", "write", "meta"),
                Op("step", "H2D", ("meta_host", "meta_device", nbytes)),
                Op("step", "record", "copied")]
    assert fake.log == staged(2) + staged(1)
    decode._stage(None, 2)  # all padding: no table rows copied
    assert fake.log[-4:] == staged(0)


def test_a_replay_copies_its_metadata_beside_the_last_replay_and_waits_for_it(fake):
    """DecodeGraphs.run: each replay's metadata copy goes on the staging stream once the
    replay before it is over (it overwrites what that one read), so it overlaps the
    sampling kernel queued after that replay; the replay waits for its own copy. The host
    rewrites its buffer only once the copy before has read it."""
    decode = decode_graphs(fake, width=5, bucket=4)

    class Graph:
        def launch(self, stream):
            fake.add(Op(stream.name, "kernel", "replay"))

    for size in decode.buckets:
        decode._graphs[(size, 64)] = (Graph(), np.zeros((size, 8), np.float32))
    for step in range(STEPS):
        decode.run(decode_batch([11 + step, 12], [6 + step, 7], [[1, 2, 3], [4, 5, 6]]))
        fake.add(Op("step", "kernel", "sample"))  # what the engine queues after a replay
    log = fake.log
    copies = [i for i, op in enumerate(log) if op.what == "H2D"]
    replays = [i for i, op in enumerate(log) if op.detail == "replay"]
    samples = [i for i, op in enumerate(log) if op.detail == "sample"]
    writes = [i for i, op in enumerate(log) if op.what == "write"]
    assert len(copies) == len(replays) == len(writes) == STEPS
    for step in range(STEPS):
        assert log[copies[step]].who == "stage" and log[replays[step]].who == "step"
        assert ordered(log, copies[step], replays[step])
        assert writes[step] < copies[step]  # written before the copy is queued
        if step:
            assert ordered(log, replays[step - 1], copies[step])
            # not behind the sampling kernel queued after the last replay
            assert not ordered(log, samples[step - 1], copies[step])
            assert ordered(log, copies[step - 1], writes[step])



def test_replays_and_eager_runs_of_any_bucket_never_copy_over_what_one_reads(fake):
    """run and run_uncaptured in turn, on two streams, for buckets that change: each copy
    into the one metadata buffer comes after every kernel that read it before (replays and
    eager forwards), and each of those after its own copy."""
    decode = decode_graphs(fake, width=5, bucket=4)
    step, other = fake.current, FakeStream(fake, "other")

    class Graph:
        def launch(self, stream):
            fake.add(Op(stream.name, "kernel", "replay"))

    def forward(bucket, limit):
        fake.add(Op(fake.current.name, "kernel", "forward"))
        return np.zeros((bucket, 8), np.float32)

    decode._forward = forward
    for size in decode.buckets:
        decode._graphs[(size, 64)] = (Graph(), np.zeros((size, 8), np.float32))
    plan = [(decode.run, step, 2), (decode.run_uncaptured, other, 1), (decode.run, step, 3),
            (decode.run, step, 1), (decode.run_uncaptured, step, 4), (decode.run, other, 2),
            (decode.run_uncaptured, other, 3), (decode.run, step, 4)]
    for run, stream, num_seqs in plan:
        fake.current = stream
        run(decode_batch(list(range(1, num_seqs + 1)), [5] * num_seqs, [[1, 2]] * num_seqs))
    log = fake.log
    copies = [i for i, op in enumerate(log) if op.what == "H2D"]
    readers = [i for i, op in enumerate(log) if op.detail in ("replay", "forward")]
    assert len(copies) == len(readers) == len(plan)
    for n, (copy, reader) in enumerate(zip(copies, readers)):
        assert ordered(log, copy, reader)
        for earlier in readers[:n]:
            assert ordered(log, earlier, copy), (n, log[earlier], log[copy])

# ---- StepGraphs._stage -------------------------------------------------------------------
def test_step_graph_stage_pads_the_tokens_and_copies_the_sequences_rows(fake):
    width = 5
    backend = types.SimpleNamespace(max_num_tokens=40, max_num_seqs=4,
                                    ops=types.SimpleNamespace(max_blocks_per_seq=width))
    steps = graphs.StepGraphs(backend)
    assert steps.buckets == [16, 32, 40]
    fake.name(steps._host, "meta_host")
    fake.name(steps._device, "meta_device")
    steps._copied.name = "copied"
    # two sequences: a 3-token prefill chunk after 4 cached tokens, and a decode token
    batch = ForwardBatch(token_ids=np.array([7, 8, 9, 5], np.int32),
                         positions=np.array([4, 5, 6, 20], np.int32),
                         slot_mapping=np.array([44, 45, 46, 120], np.int32),
                         query_start_loc=np.array([0, 3, 4], np.int32),
                         seq_lens=np.array([7, 21], np.int32),
                         block_tables=np.array([[2, -1], [6, 7]], np.int32),
                         max_query_len=3, max_seq_len=21)
    assert steps.can_run(batch) and steps.bucket_for(batch.num_tokens) == 16
    steps._stage(batch, 16)
    view = lambda name, rows: steps.layout.view(steps._host, name, rows)
    assert view("token_ids", 16).tolist() == [7, 8, 9, 5] + [0] * 12
    assert view("positions", 16).tolist() == [4, 5, 6, 20] + [0] * 12
    assert view("slot_mapping", 16).tolist() == [44, 45, 46, 120] + [-1] * 12  # no KV write
    assert view("query_start_loc", 2).tolist() == [0, 3, 4]
    assert view("seq_lens", 2).tolist() == [7, 21] and view("last_token_indices", 2).tolist() == [2, 3]
    assert view("block_tables", 2)[:, :2].tolist() == [[2, -1], [6, 7]]
    nbytes = 4 * (steps.layout.offsets["block_tables"] + 2 * width)
    assert fake.log[-2:] == [Op("step", "H2D", ("meta_host", "meta_device", nbytes)),
                             Op("step", "record", "copied")]
    decode = ForwardBatch(token_ids=np.array([1], np.int32), positions=np.array([3], np.int32),
                          slot_mapping=np.array([3], np.int32),
                          query_start_loc=np.array([0, 1], np.int32), seq_lens=np.array([4], np.int32),
                          block_tables=np.array([[0]], np.int32), max_query_len=1, max_seq_len=4)
    assert not steps.can_run(decode)  # the decode graphs' step
    # what a whole-step graph is captured on: all padding and one sequence of no tokens
    # and no keys (attention reads nothing), its table row zeros
    steps._stage(None, 16, empty_seqs=1)
    assert view("token_ids", 16).tolist() == [0] * 16
    assert view("slot_mapping", 16).tolist() == [-1] * 16
    assert view("query_start_loc", 1).tolist() == [0, 0]
    assert view("seq_lens", 1).tolist() == [0] and view("last_token_indices", 1).tolist() == [0]
    assert view("block_tables", 1).tolist() == [[0] * width]
    nbytes = 4 * (steps.layout.offsets["block_tables"] + width)
    assert fake.log[-2:] == [Op("step", "H2D", ("meta_host", "meta_device", nbytes)),
                             Op("step", "record", "copied")]

"""Launcher for sampling.cu: one CTA per sequence picks its next token on the device (more
share its argmax pass while the batch leaves SMs idle)."""
from __future__ import annotations

import numpy as np

from ...interface import KERNEL_ROWS, MAX_BIAS_ENTRIES
from .device import device_limits
from .kernels import F32, I32, U8, check, constants, get_kernel, i32, opt_in_shared, x_macro

_C = constants("sampling")
THREADS = _C["SAMPLE_THREADS"]
PROCESS_THREADS = _C["PROCESS_THREADS"]
CANDIDATE_CUT = _C["CANDIDATE_CUT"]  # candidates lie within this many temperatures of the max
SLOT_BYTES = _C["SLOT_BYTES"]  # shared memory of one candidate slot of every thread
U64 = np.dtype(np.uint64)
U32 = np.dtype(np.uint32)
MASK_SKIP = _C["MASK_SKIP"]  # mask_rows: the launch draws no token for the row
# Candidate slots per thread (sampling.cu, "Candidates"): 8 bytes per slot and thread, so
# 16 slots take 128 KiB of shared memory and hold up to 16,384 candidates, with room for
# sixteen times the mean in any one thread when a row has 1,000 of them. (SmolLM2-135M-
# Instruct at temperature 0.6: 176 of 184 steps fit 8 slots, 183 fit 16.)
SLOTS = 16
# The split argmax pass (sampling.cu, "Split argmax"): a row's CTAs each scan at least this
# many logits, at most ARGMAX_MAX_SPLITS of them, and a launch splits only while its rows'
# CTAs fit on the GPU's SMs together
ARGMAX_SHARE = 8192
ARGMAX_MAX_SPLITS = _C["ARGMAX_MAX_SPLITS"]

# the C type of each numpy dtype a settings row may have
C_TYPES = {np.dtype(np.uint64): "unsigned long long", np.dtype(np.int32): "int",
           np.dtype(np.float32): "float", np.dtype(np.uint32): "unsigned int"}


def check_settings_layout() -> None:
    """sampling.cu's SAMPLING_ROWS must list interface.SAMPLING_ROWS's kernel rows: the
    same names, types and order (the kernel finds each array at the offset that order
    gives)."""
    in_source = x_macro("sampling", "SAMPLING_ROWS")
    in_table = tuple((C_TYPES[np.dtype(row.dtype)], row.name) for row in KERNEL_ROWS)
    if in_source != in_table:
        raise RuntimeError(f"cuda_src/sampling.cu's SAMPLING_ROWS {list(in_source)} differs from "
                           f"interface.SAMPLING_ROWS's kernel rows {list(in_table)}; make them "
                           "list the same rows in the same order")


check_settings_layout()


def settings_bytes(capacity: int) -> int:
    """The size of a settings buffer for `capacity` sequences."""
    return capacity * sum(np.dtype(row.dtype).itemsize for row in KERNEL_ROWS)


def settings_views(buffer, capacity: int, rows: int | None = None) -> dict:
    """{name: array} of each kernel row in a flat uint8 settings buffer (numpy or cupy)
    that holds `capacity` sequences; rows: only the first `rows` entries of each."""
    views, start = {}, 0
    for row in KERNEL_ROWS:
        size = np.dtype(row.dtype).itemsize
        count = capacity if rows is None else rows
        views[row.name] = buffer[start:start + count * size].view(row.dtype)
        start += capacity * size
    return views


def slot_room() -> int:
    """The most candidate slots the device's shared memory per block holds beside the
    kernel's static shared memory (SampleShared)."""
    static = get_kernel("sampling", "sample_kernel").shared_size_bytes
    return max(0, (device_limits()["max_shared_per_block"] - static) // SLOT_BYTES)


def default_slots() -> int:
    """SLOTS, or as many as the device's shared memory per block holds."""
    return min(SLOTS, slot_room())


def argmax_splits(num_seqs: int, vocab: int) -> int:
    """How many CTAs share each row's argmax pass (sampling.cu, "Split argmax")."""
    most = min(ARGMAX_MAX_SPLITS, vocab // ARGMAX_SHARE)
    if most < 2 or not num_seqs:
        return 1
    return max(1, min(most, device_limits()["sms"] // num_seqs))


_argmax_workspace = {}  # device id -> (parts [n] int2 as int32 [n, 2], arrivals [n] uint32)


def argmax_workspace(entries: int):
    """The split argmax pass's posts and tickets for `entries` CTAs at least (the tickets
    zero between launches: the kernel puts each back), kept per device and grown as asked.
    Launches that share them must run one after another, as the engine's do on its one
    stream: two launches at once would mix their tickets."""
    import cupy
    device = cupy.cuda.Device().id
    held = _argmax_workspace.get(device)
    if held is None or held[1].size < entries:
        held = _argmax_workspace[device] = (cupy.empty((entries, 2), np.int32),
                                            cupy.zeros(entries, np.uint32))
    return held


def pack_settings(num_seqs: int, **rows):
    """A device settings buffer for num_seqs sequences: each kernel row of SAMPLING_ROWS
    from `rows` (a cupy or numpy array [num_seqs], or one value for all), the row's
    neutral value (else its default) where it is not given."""
    import cupy
    host = np.zeros(settings_bytes(num_seqs), np.uint8)
    unknown = set(rows) - {row.name for row in KERNEL_ROWS}
    if unknown:
        raise ValueError(f"not a sampling kernel row: {sorted(unknown)[0]}")
    for row in KERNEL_ROWS:
        view = settings_views(host, num_seqs)[row.name]
        value = rows.get(row.name, row.default if row.neutral is None else row.neutral)
        view[:] = cupy.asnumpy(value) if isinstance(value, cupy.ndarray) else value
    return cupy.asarray(host)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out_tokens, slots=None,
           used_slots=None, bitmask=None, mask_rows=None, splits=None):
    """logits [B, V] float32; per-sequence settings [B] (float32 temperature / top_p /
    min_p, int32 top_k / steps, uint64 seeds) -> out_tokens [B] int32, on the device: the
    settings packed into a new buffer (pack_settings), then sample_settings (as are slots,
    used_slots, bitmask, mask_rows and splits). For tests; the engine and the benchmarks
    stage their buffer once."""
    num_seqs = check("logits", logits, F32, ndim=2).shape[0]
    given = {"temperature": (temperature, F32), "top_k": (top_k, I32), "top_p": (top_p, F32),
             "min_p": (min_p, F32), "seeds": (seeds, U64), "steps": (steps, I32)}
    rows = {name: check(name, array, dtype, shape=(num_seqs,))
            for name, (array, dtype) in given.items()}
    sample_settings(logits, pack_settings(num_seqs, **rows), num_seqs, out_tokens, slots,
                    used_slots, bitmask=bitmask, mask_rows=mask_rows, splits=splits)


def sample_settings(logits, settings, capacity: int, out_tokens, slots=None, used_slots=None,
                    counts=None, bitmask=None, mask_rows=None, splits=None):
    """logits [B, V] float32; settings: a flat uint8 buffer of the SAMPLING_ROWS kernel rows
    of `capacity` >= B sequences (settings_views) -> out_tokens [B] int32, on the device.
    slots: candidate slots per thread (default_slots(); 0 makes every pass read the whole
    row, which draws the same tokens); used_slots: None or [B] int32, set to 1 where the
    candidate slots served the draw. counts: None, or the slots' token counts
    (SlotState.counts), to which each kept token of a row with state is added. Structured
    outputs: mask_rows [B] int32, row b's bitmask row, -1 for none, MASK_SKIP for a row this
    launch leaves alone; bitmask [R, W] uint32 (W * 32 >= V), needed where a mask row is
    >= 0 (sampling.cu, "Structured outputs"). splits: the CTAs of each row's argmax pass
    (default argmax_splits; any count up to ARGMAX_MAX_SPLITS draws the same tokens)."""
    num_seqs, vocab = check("logits", logits, F32, ndim=2).shape
    check("settings", settings, U8, ndim=1)
    if counts is not None:
        check("counts", counts, I32, shape=(None, vocab))
    if settings.size < settings_bytes(capacity):
        raise ValueError(f"settings: {settings.size} bytes, {capacity} sequences need "
                         f"{settings_bytes(capacity)}")
    check("out_tokens", out_tokens, I32, shape=(num_seqs,))
    if num_seqs > capacity:
        raise ValueError(f"settings: {capacity} sequences' room, {num_seqs} logits rows")
    if used_slots is not None:
        check("used_slots", used_slots, I32, shape=(num_seqs,))
    if bitmask is not None and mask_rows is None:
        raise ValueError("a bitmask needs mask_rows")
    mask_words = 0
    if mask_rows is not None:
        check("mask_rows", mask_rows, I32, shape=(num_seqs,))
    if bitmask is not None:
        mask_words = check("bitmask", bitmask, U32, ndim=2).shape[1]
        if mask_words * 32 < vocab:
            raise ValueError(f"bitmask rows of {mask_words} words do not cover {vocab} tokens")
    if slots is None:
        slots = default_slots()
    else:
        slots = int(slots)
        if not 0 <= slots <= slot_room():
            raise ValueError(f"slots must be in [0, {slot_room()}] on this GPU (its shared "
                             f"memory per block), got {slots}")
    if splits is None:
        splits = argmax_splits(num_seqs, vocab)
    elif (isinstance(splits, bool) or not isinstance(splits, int)
          or not 1 <= splits <= ARGMAX_MAX_SPLITS):
        raise ValueError(f"splits must be in [1, {ARGMAX_MAX_SPLITS}] (an integer), "
                         f"got {splits!r}")
    if not num_seqs:
        return
    parts = arrivals = np.uintp(0)
    if splits > 1:
        parts, arrivals = argmax_workspace(num_seqs * splits)
    kernel = get_kernel("sampling", "sample_kernel")
    shared = slots * SLOT_BYTES
    opt_in_shared(kernel, shared)
    kernel((num_seqs, splits), (THREADS,),
           (logits, i32(vocab), settings, i32(capacity), out_tokens, i32(slots),
            used_slots if used_slots is not None else np.uintp(0),
            counts if counts is not None else np.uintp(0),
            bitmask if bitmask is not None else np.uintp(0), i32(mask_words),
            mask_rows if mask_rows is not None else np.uintp(0), parts, arrivals),
           shared_mem=shared)


class SlotState:
    """The device state of the engine's slots that the penalties, biases and bans read
    (sampling.cu, "penalties, biases and bans"), allocated the first time a step uses it:
    [num_slots, V] int32 counts and uint8 prompt flags, [num_slots, MAX_BIAS_ENTRIES] bias
    entries."""

    def __init__(self, cupy, num_slots: int, vocab: int):
        self.vocab = vocab
        self.counts = cupy.zeros((num_slots, vocab), np.int32)
        self.prompt_seen = cupy.zeros((num_slots, vocab), np.uint8)
        self.bias_ids = cupy.zeros((num_slots, MAX_BIAS_ENTRIES), np.int32)
        self.bias_values = cupy.zeros((num_slots, MAX_BIAS_ENTRIES), np.float32)
        # the resets' packed lists go up through a pinned buffer and one asynchronous copy
        # (a copy from pageable memory would wait for the step stream: the forward pass
        # queued before it); both buffers grow when a reset needs more
        self._cupy = cupy
        self._staged_host = self._staged_device = None
        self._staged_copied = None  # event: the last copy out of the pinned buffer is done

    def stage(self, packed: np.ndarray):
        """packed (int32) on the device, copied on the current stream; returns the device
        view. The pinned buffer is rewritten only once its last copy is over."""
        cupy = self._cupy
        if self._staged_copied is not None:
            self._staged_copied.synchronize()
        if self._staged_host is None or self._staged_host.size < packed.size:
            size = max(packed.size, 2 * (0 if self._staged_host is None else self._staged_host.size),
                       1 << 16)
            memory = cupy.cuda.alloc_pinned_memory(4 * size)
            self._staged_host = np.frombuffer(memory, np.int32, size)
            self._staged_device = cupy.empty(size, np.int32)
            self._staged_copied = cupy.cuda.Event(disable_timing=True)
        self._staged_host[:packed.size] = packed
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._staged_device.data.ptr, self._staged_host.ctypes.data,
                                      4 * packed.size, 1, stream.ptr)  # host to device
        self._staged_copied.record(stream)
        return self._staged_device[:packed.size]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.counts, self.prompt_seen, self.bias_ids,
                                      self.bias_values))


def reset_state(state: SlotState, resets, last_sampled) -> None:
    """Make the slots of `resets` (interface.SlotReset) anew: their counts and prompt flags
    from their tokens (an id -(i + 1): last_sampled[i], the last sampling call's row i), and
    their bias entries. One upload of the resets' packed lists, one kernel."""
    if not resets:
        return
    check("last_sampled", last_sampled, I32, ndim=1)
    num_slots = state.counts.shape[0]
    tokens, token_start, num_prompt, entry_ids, entry_values, entry_start = [], [0], [], [], [], [0]
    for reset in resets:
        if not 0 <= reset.slot < num_slots:
            raise ValueError(f"reset of slot {reset.slot}: there are {num_slots}")
        tokens += reset.prompt_token_ids
        tokens += reset.output_token_ids
        token_start.append(len(tokens))
        num_prompt.append(len(reset.prompt_token_ids))
        entry_ids += reset.bias_ids
        entry_values += reset.bias_values
        entry_start.append(len(entry_ids))
        if entry_start[-1] - entry_start[-2] > MAX_BIAS_ENTRIES:
            raise ValueError(f"slot {reset.slot}: more than {MAX_BIAS_ENTRIES} bias entries")
    R = len(resets)
    packed = np.concatenate([
        np.array([reset.slot for reset in resets], np.int32), np.array(token_start, np.int32),
        np.array(num_prompt, np.int32), np.array(entry_start, np.int32),
        np.array(tokens, np.int32), np.array(entry_ids, np.int32),
        np.array(entry_values, np.float32).view(np.int32)])
    device = state.stage(packed)
    parts, start = [], 0
    for size in (R, R + 1, R, R + 1, len(tokens), len(entry_ids), len(entry_values)):
        parts.append(device[start:start + size])
        start += size
    slots, token_start_d, num_prompt_d, entry_start_d, tokens_d, ids_d, values_d = parts
    kernel = get_kernel("sampling", "reset_state_kernel")
    kernel((R,), (PROCESS_THREADS,),
           (state.counts, state.prompt_seen, state.bias_ids, state.bias_values,
            i32(state.vocab), i32(MAX_BIAS_ENTRIES), slots, token_start_d, num_prompt_d,
            tokens_d, entry_start_d, ids_d, values_d.view(np.float32), last_sampled))


def process_logits(logits, settings, capacity: int, state: SlotState) -> None:
    """Apply each row's bias entries, bans and penalties to its logits [B, V] float32, in
    place, for the rows whose settings name a slot (state_slot >= 0)."""
    num_seqs, vocab = check("logits", logits, F32, ndim=2).shape
    check("settings", settings, U8, ndim=1)
    if vocab != state.vocab:
        raise ValueError(f"logits: {vocab} columns, the slot state was made for {state.vocab}")
    if num_seqs > capacity:
        raise ValueError(f"settings: {capacity} sequences' room, {num_seqs} logits rows")
    if not num_seqs:
        return
    kernel = get_kernel("sampling", "process_logits_kernel")
    kernel((num_seqs,), (PROCESS_THREADS,),
           (logits, i32(vocab), settings, i32(capacity), state.counts, state.prompt_seen,
            state.bias_ids, state.bias_values, i32(MAX_BIAS_ENTRIES)))

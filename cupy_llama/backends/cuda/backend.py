"""The model on one CUDA GPU: one weight blob, one activation pool, one KV allocation.

Memory is planned once at start-up (docs/ARCHITECTURE.md, "Memory plan") and printed as a table; nothing
is allocated inside the step loop."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...errors import DeviceError
from ...interface import MAX_BIAS_ENTRIES, Fp8Weight
from ...util import cdiv, counted
from ...weights import Checkpoint, iter_blob_pieces, quantized_entries, scale_key
from . import attention as attention_kernels
from . import fp8 as fp8_kernels
from . import sampling as sampling_kernels
from .cublaslt import fp8_lt
from .device import check_cuda_device, device_name, import_cupy
from .ops import CudaOps
from .switches import KernelSwitches
from .weight_upload import upload_weight_pieces

ALIGNMENT = 256
GiB = 2 ** 30
# pool buffers that are never alive at the same time share memory (models/decoder.py):
# qkv is consumed by rope_and_cache before gate_up is written; q by attention before act
SHARED_BUFFERS = (("qkv", "gate_up"), ("q", "act"))
NAN_BF16 = 0x7FC0


@dataclass
class PoolRegion:
    names: tuple[str, ...]  # buffers living here (more than one: they share the memory)
    offset: int
    nbytes: int


def release_cached_memory(cupy) -> None:
    """Give the blocks CuPy's pools keep for reuse back to the device (CuPy caches freed
    memory, and the device's free-memory query does not count it): what an engine that was
    closed, or dropped and collected, held."""
    import gc
    gc.collect()  # an engine in a reference cycle is freed only by the collector
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _align(n: int) -> int:
    return cdiv(n, ALIGNMENT) * ALIGNMENT


FLOAT32_BUFFERS = ("residual", "residual_mid", "last_residual", "logits")
# A prompt's scored rows go through the LM head in pieces of as many rows as the logits
# buffer holds: max_num_seqs, or more, up to this many bytes of float32 logits, so that a
# prompt of about a thousand tokens is one product (docs/ARCHITECTURE.md, "Prompt
# log-probabilities")
SCORE_LOGITS_BYTES = 512 * 2 ** 20


def score_rows(vocab_size: int, max_num_tokens: int, max_num_seqs: int) -> int:
    """Rows of the logits buffer: max_num_seqs, or the prompt rows that fit in
    SCORE_LOGITS_BYTES where that is more (no more than a step has tokens)."""
    return max(max_num_seqs, min(max_num_tokens, SCORE_LOGITS_BYTES // (4 * vocab_size)))


def weight_format(config) -> str:
    """The weights' formats in words, for the memory plan."""
    if config.quantization == "fp8":
        return "bf16 with the projections in FP8 (e4m3 and a float32 scale per row)"
    return "bf16"


def buffer_dtype(name: str):
    """The residual stream and the logits are float32; every other activation is bf16."""
    return np.float32 if name in FLOAT32_BUFFERS else np.uint16


def plan_pool(model, max_num_tokens: int, max_num_seqs: int, max_model_len: int,
              num_rows: int) -> tuple[dict[str, PoolRegion], int]:
    """Regions of the activation pool of a model (a models/ Decoder) by buffer name (shared
    buffers map to one region), plus the split-KV decode workspace; returns (regions,
    total bytes). num_rows: the per-sequence buffers' rows (score_rows)."""
    config = model.config
    shapes = model.buffer_shapes(max_num_tokens, num_rows)
    sizes = {name: int(np.prod(shape)) * np.dtype(buffer_dtype(name)).itemsize
             for name, shape in shapes.items()}
    partial_out, partial_lse = attention_kernels.workspace_sizes(
        max_num_seqs, config.num_attention_heads, config.head_dim, max_model_len)
    sizes["attn_partial_out"] = 4 * partial_out
    sizes["attn_partial_lse"] = 4 * partial_lse
    groups = [g for g in SHARED_BUFFERS if all(n in sizes for n in g)]
    grouped = {n for g in groups for n in g}
    groups += [(n,) for n in sizes if n not in grouped]
    regions, offset = {}, 0
    for group in groups:
        region = PoolRegion(group, offset, _align(max(sizes[n] for n in group)))
        for name in group:
            regions[name] = region
        offset += region.nbytes
    return regions, offset


class CudaBackend:
    device = "cuda"

    def __init__(self, model, checkpoint: Checkpoint, *, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, switches: KernelSwitches | None = None,
                 log=None):
        """model: a models/ Decoder, whose weights the checkpoint holds. switches: which
        kernels run; default: KernelSwitches.from_environment()."""
        config = model.config
        self.capability = check_cuda_device()
        cupy = import_cupy()
        self._cupy = cupy
        self.switches = KernelSwitches.from_environment() if switches is None else switches
        # memory that engines closed or dropped earlier in this process left in CuPy's
        # pools goes back to the device first, so the sizing below sees it as free
        release_cached_memory(cupy)
        self.model, self.config = model, config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # a decode step has one token per sequence, so the pool holds at least max_num_seqs
        self.max_num_tokens = max(max_num_batched_tokens, max_num_seqs)
        self._log = log or (lambda message: None)
        device = cupy.cuda.Device()
        free, total = cupy.cuda.runtime.memGetInfo()

        plan, weight_bytes = model.weight_plan()
        if quantized_entries(plan) and self.capability < fp8_kernels.MIN_CAPABILITY:
            raise DeviceError(
                f"--quantization fp8 quantizes on the GPU, which needs compute capability "
                f"{fp8_kernels.MIN_CAPABILITY // 10}.{fp8_kernels.MIN_CAPABILITY % 10} or newer "
                f"(this one has {self.capability // 10}.{self.capability % 10}); run the bf16 "
                "weights, or an FP8 checkpoint")
        self.score_rows = score_rows(config.vocab_size, self.max_num_tokens, max_num_seqs)
        self._regions, pool_bytes = plan_pool(model, self.max_num_tokens, max_num_seqs,
                                              max_model_len, self.score_rows)
        rope_tables = model.rope_tables(max_model_len)
        rope_bytes = sum(table.nbytes for table in {id(t): t for t in rope_tables.values()}.values())
        # FP8 products of more than 16 rows: their x quantized per row (cuBLASLt), or
        # their weights dequantized to bf16 (gemm.py)
        fp8_entries = [e for e in plan.values() if e.dtype == "e4m3"]
        dequantized_bytes = 2 * max((int(np.prod(e.shape)) for e in fp8_entries), default=0)
        longest_k = max((e.shape[1] for e in fp8_entries), default=0)
        widest_n = max((e.shape[0] for e in fp8_entries), default=0)
        fp8_x_sizes = (_align(self.max_num_tokens * longest_k), _align(4 * self.max_num_tokens),
                       4 * self.max_num_tokens * widest_n)
        fp8_x_bytes = sum(fp8_x_sizes) if fp8_entries else 0
        # the penalties' token counts and prompt flags per slot, and the bias entries
        slot_state_bytes = max_num_seqs * (5 * config.vocab_size + 8 * MAX_BIAS_ENTRIES)
        needed = (weight_bytes + pool_bytes + rope_bytes + dequantized_bytes + fp8_x_bytes
                  + slot_state_bytes)
        if needed > free:
            raise DeviceError(
                f"not enough GPU memory: the weights and activation buffers need "
                f"{needed / GiB:.2f} GiB but {free / GiB:.2f} GiB of {total / GiB:.2f} GiB is "
                "free; free the GPU or lower --max-num-batched-tokens / --max-num-seqs")

        started = time.perf_counter()
        self._blob = self._allocate(weight_bytes, "the weights")
        upload_weight_pieces(cupy, self._blob, iter_blob_pieces(checkpoint, plan))
        self.weights = self._weight_views(plan)
        self._quantize(checkpoint, plan)
        self._dequantized = (self._allocate(dequantized_bytes, "the FP8 dequantization scratch")
                             .view(np.uint16) if dequantized_bytes else None)
        self._fp8_x = None  # x quantized per row (codes, scales) and the products' sums
        if fp8_x_bytes:
            scratch = self._allocate(fp8_x_bytes, "the FP8 activation scratch")
            codes_end = fp8_x_sizes[0]
            scales_end = codes_end + fp8_x_sizes[1]
            self._fp8_x = (scratch[:codes_end], scratch[codes_end:scales_end].view(np.float32),
                           scratch[scales_end:].view(np.float32))
            if self.switches.fp8_gemm == "cublaslt":
                fp8_lt()  # its handle and workspace now, not while a graph is captured
        self.load_seconds = time.perf_counter() - started
        on_device = {}  # layer types that share a table share its copy
        self.rope_tables = {kind: on_device.setdefault(id(table), cupy.asarray(table))
                            for kind, table in rope_tables.items()}
        self._pool = self._allocate(pool_bytes, "the activation buffers")
        self._buffer_views = {}
        self._slot_state = sampling_kernels.SlotState(cupy, max_num_seqs, config.vocab_size)

        self.kv_bytes_per_block = (2 * config.num_hidden_layers * block_size
                                   * config.kv_size * 2)
        self.num_kv_blocks = self._kv_blocks(num_kv_blocks, gpu_memory_utilization)
        kv_shape = (config.num_hidden_layers, 2, self.num_kv_blocks, block_size,
                    config.num_key_value_heads, config.head_dim)
        self._kv = self._allocate(int(np.prod(kv_shape)) * 2, "the KV cache").view(np.uint16)
        self._kv = self._kv.reshape(kv_shape)
        self._kv.fill(NAN_BF16)  # a stray read of a never-written slot shows as NaN
        self.kv_caches = [(self._kv[i, 0], self._kv[i, 1]) for i in range(config.num_hidden_layers)]

        max_blocks_per_seq = cdiv(max_model_len, block_size)
        workspace = (self._region_view("attn_partial_out", np.float32),
                     self._region_view("attn_partial_lse", np.float32))
        self.ops = CudaOps(max_num_tokens=self.max_num_tokens, max_num_seqs=max_num_seqs,
                           max_blocks_per_seq=max_blocks_per_seq,
                           num_heads=config.num_attention_heads, head_dim=config.head_dim,
                           max_model_len=max_model_len, workspace=workspace,
                           switches=self.switches, dequantized=self._dequantized,
                           fp8_activations=self._fp8_x,
                           slot_state=self._slot_state)

        self._log(f"GPU {device.id}: {device_name(device)} (sm_{self.capability}), "
                  f"weights loaded in {self.load_seconds:.2f} s")
        for name, nbytes, note in self.memory_plan():
            self._log(f"  {name:<24} {nbytes / GiB:9.3f} GiB  {note}")
        self._log(f"KV cache: {counted(self.num_kv_blocks, 'block')} x {block_size} tokens = "
                  f"{self.num_kv_blocks * block_size} tokens "
                  f"({self.num_kv_blocks * self.kv_bytes_per_block / GiB:.2f} GiB)")

        # CUDA graphs for decode steps (docs/ARCHITECTURE.md, Decisions 8), captured now so the first
        # steps run at full speed; a capture failure leaves the engine eager, with a warning
        self.graphs = self.step_graphs = None
        self.graphs_off_reason = "enforce_eager=True" if enforce_eager else None
        if not enforce_eager:
            self.enable_graphs()

    def _weight_views(self, plan) -> dict:
        """The blob's entries as device arrays by key: bf16 ones as uint16, each FP8 entry
        as an Fp8Weight of its codes (uint8) and its scales' entry (float32)."""
        views = {"bf16": np.uint16, "e4m3": np.uint8, "f32": np.float32}
        arrays = {key: self._blob[e.offset:e.offset + e.nbytes].view(views[e.dtype]).reshape(e.shape)
                  for key, e in plan.items()}
        weights = {}
        for key, entry in plan.items():
            if entry.dtype == "e4m3":
                weights[key] = Fp8Weight(arrays[key], arrays[scale_key(key)])
            elif entry.dtype == "bf16":
                weights[key] = arrays[key]
        return weights

    def _quantize(self, checkpoint: Checkpoint, plan) -> None:
        """Make the FP8 entries the plan quantizes at load: each bf16 source tensor goes to
        the device and is quantized there into its rows of the codes and scales; no bf16
        copy stays behind."""
        cupy = self._cupy
        for codes, _ in quantized_entries(plan):
            weight, row = self.weights[codes.key], 0
            for name in codes.sources:
                source = cupy.asarray(np.ascontiguousarray(checkpoint.read_bf16(name)))
                rows = source.shape[0]
                fp8_kernels.quantize_rows(source, weight.data[row:row + rows],
                                          weight.scale[row:row + rows])
                row += rows
                del source
        if quantized_entries(plan):
            cupy.cuda.get_current_stream().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()  # the bf16 copies' memory

    def enable_graphs(self) -> bool:
        """Capture decode graphs for every batch-size bucket and step graphs for every
        token-count bucket; False (and a logged reason) where capturing fails."""
        from .graphs import DecodeGraphs, StepGraphs
        try:
            graphs = DecodeGraphs(self, log=self._log)
            graphs.capture_all()
            step_graphs = StepGraphs(self, log=self._log)
            step_graphs.capture_all()
        except Exception as e:  # NotImplementedError, CUDARuntimeError, RuntimeError
            first_line = (str(e).strip().splitlines() or [""])[0]
            self.graphs = self.step_graphs = None
            self.graphs_off_reason = f"{type(e).__name__}: {first_line}"
            self._log(f"warning: CUDA graphs are off, steps run eagerly ({self.graphs_off_reason})")
            return False
        self.graphs, self.step_graphs, self.graphs_off_reason = graphs, step_graphs, None
        return True

    def use_switches(self, switches: KernelSwitches) -> None:
        """Run other kernels from now on (timing tools compare them on one loaded model):
        new ops on the same memory, and the captured graphs dropped with the old ones."""
        self._cupy.cuda.get_current_stream().synchronize()
        old = self.ops
        self.switches = switches
        self.ops = CudaOps(max_num_tokens=self.max_num_tokens, max_num_seqs=self.max_num_seqs,
                           max_blocks_per_seq=old.max_blocks_per_seq,
                           num_heads=self.config.num_attention_heads,
                           head_dim=self.config.head_dim, max_model_len=self.max_model_len,
                           workspace=(old._partial_out, old._partial_lse), switches=switches,
                           dequantized=self._dequantized, fp8_activations=self._fp8_x,
                           slot_state=self._slot_state)
        if self.graphs is not None:
            self.graphs = self.step_graphs = None
            self.enable_graphs()

    def close(self) -> None:
        """Hand the device memory back: weights, activations, KV cache, graphs and pinned
        buffers. The backend cannot run afterwards; closing twice does nothing."""
        if getattr(self, "_closed", False):
            return
        self._cupy.cuda.get_current_stream().synchronize()
        self._closed = True
        for name in ("graphs", "step_graphs", "ops", "weights", "kv_caches", "_kv", "_blob", "_pool",
                     "_buffer_views", "rope_tables", "_dequantized", "_fp8_x", "_slot_state"):
            self.__dict__.pop(name, None)
        release_cached_memory(self._cupy)

    def forward(self, batch, prompt=None):
        """One step of the model (models/decoder.py): decode batches replay a decode graph,
        other steps of up to graphs.STEP_BUCKETS[-1] tokens their bucket's step graphs with
        attention in between, when graphs are on; everything else runs eagerly. prompt: an
        interface.PromptLogprobRequest (only steps with a prefill have one), computed after
        the last layer either way. Returns logits [B, V] float32 (a pool view)."""
        if prompt is None and self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        if self.step_graphs is not None and self.step_graphs.can_run(batch):
            return self.step_graphs.run(batch, prompt)
        return self.model.forward(self, batch, prompt)

    def _allocate(self, nbytes: int, what: str):
        cupy = self._cupy
        try:
            return cupy.empty(max(1, nbytes), np.uint8)
        except cupy.cuda.memory.OutOfMemoryError:
            free, _ = cupy.cuda.runtime.memGetInfo()
            raise DeviceError(f"out of GPU memory allocating {what}: {nbytes / GiB:.2f} GiB "
                              f"needed, {free / GiB:.2f} GiB free") from None

    def _kv_blocks(self, num_kv_blocks, gpu_memory_utilization) -> int:
        cupy = self._cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        one_sequence = cdiv(self.max_model_len, self.block_size)
        if num_kv_blocks is not None:
            needed = num_kv_blocks * self.kv_bytes_per_block
            if needed > free:
                raise DeviceError(f"num_kv_blocks={num_kv_blocks} needs {needed / GiB:.2f} GiB "
                                  f"of KV cache but {free / GiB:.2f} GiB is free; lower it")
            # as on the CPU: a pool smaller than one max_model_len sequence is allowed, the
            # engine then stops each sequence when it would outgrow the pool
            return num_kv_blocks
        if not 0 < gpu_memory_utilization <= 1:
            raise DeviceError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        # use memory up to `gpu_memory_utilization` of the whole GPU, counting what is in use
        budget = free - (1 - gpu_memory_utilization) * total
        blocks = int(max(0, budget) // self.kv_bytes_per_block)
        if blocks < one_sequence:
            need = one_sequence * self.kv_bytes_per_block
            raise DeviceError(
                f"not enough GPU memory for the KV cache of one {self.max_model_len}-token "
                f"sequence: {need / GiB:.2f} GiB needed, {max(0, budget) / GiB:.2f} GiB available "
                f"at gpu_memory_utilization={gpu_memory_utilization}; lower max_model_len or "
                "raise gpu_memory_utilization")
        return blocks

    def _region_view(self, name: str, dtype, shape=None):
        region = self._regions[name]
        itemsize = np.dtype(dtype).itemsize
        count = region.nbytes // itemsize if shape is None else int(np.prod(shape))
        view = self._pool[region.offset:region.offset + count * itemsize].view(dtype)
        return view if shape is None else view.reshape(shape)

    def buffers(self, num_tokens: int, num_seqs: int) -> dict:
        if num_tokens > self.max_num_tokens or num_seqs > self.score_rows:
            raise ValueError(f"a step of {num_tokens} tokens and {num_seqs} rows exceeds "
                             f"the pool ({self.max_num_tokens} tokens, {self.score_rows} rows)")
        key = (num_tokens, num_seqs)
        views = self._buffer_views.get(key)
        if views is None:
            if len(self._buffer_views) >= 512:
                self._buffer_views.clear()
            shapes = self.model.buffer_shapes(num_tokens, num_seqs)
            views = {name: self._region_view(name, buffer_dtype(name), shape)
                     for name, shape in shapes.items()}
            self._buffer_views[key] = views
        return dict(views)

    def memory_plan(self) -> list[tuple[str, int, str]]:
        """(name, bytes, note) rows: weights, each pool region, the KV cache."""
        config = self.config
        rows = [("weights", int(self._blob.nbytes),
                 f"{config.num_parameters / 1e9:.3f} B parameters, {weight_format(config)}, "
                 "one allocation"),
                ("rope cos/sin", sum(int(t.nbytes) for t in {id(t): t for t in self.rope_tables.values()}.values()),
                 f"{len({id(t) for t in self.rope_tables.values()})} x [{self.max_model_len}, "
                 f"{config.head_dim}] float32")]
        shapes = self.model.buffer_shapes(self.max_num_tokens, self.score_rows)
        seen = set()
        for name, region in self._regions.items():
            if id(region) in seen:
                continue
            seen.add(id(region))
            if len(region.names) > 1:
                note = "shared by " + " and ".join(
                    f"{n} {list(shapes[n])}" for n in region.names) + " (disjoint lifetimes)"
            elif name in shapes:
                note = f"{list(shapes[name])} {np.dtype(buffer_dtype(name)).name}"
            else:
                note = "split-KV decode workspace, float32"
            rows.append(("pool: " + "/".join(region.names), region.nbytes, note))
        if self._dequantized is not None:
            rows.append(("FP8 dequantized weight", int(self._dequantized.nbytes),
                         "the largest product's weight as bf16, for products past 16 rows"))
            rows.append(("FP8 quantized x and sums", int(sum(a.nbytes for a in self._fp8_x)),
                         f"x of {self.max_num_tokens} tokens in e4m3 and the float32 sums of "
                         "their widest product, for cuBLASLt"))
        if getattr(self, "graphs", None) is not None:
            from .gemm import WORKSPACE_BYTES
            rows.append(("CUDA graph metadata", int(self.graphs.metadata_bytes + self.step_graphs.metadata_bytes),
                         f"fixed step inputs of {self.graphs.max_bucket} sequences and of "
                         f"{self.step_graphs.max_tokens} tokens, int32"))
            rows.append(("cuBLAS workspace", WORKSPACE_BYTES, "fixed, so captured products never allocate"))
        if getattr(self, "_slot_state", None) is not None:
            rows.append(("sampling slot state", self._slot_state.nbytes,
                         f"token counts and prompt flags [{self.max_num_seqs}, "
                         f"{config.vocab_size}] int32 and uint8, bias entries; for the penalties"))
        rows.append(("KV cache", self.num_kv_blocks * self.kv_bytes_per_block,
                     f"{counted(self.num_kv_blocks, 'block')} x {self.block_size} tokens = "
                     f"{self.num_kv_blocks * self.block_size} tokens"))
        return rows

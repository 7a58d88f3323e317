"""Reading and validating safetensors checkpoints, and the layout of the one weight blob.

The header is parsed here (8-byte little-endian length, then UTF-8 JSON) and checked in
full before any tensor is touched; tensor data is read through a read-only mmap. Nothing
from a model directory is ever unpickled or executed: .bin/.pth checkpoints are refused.

`layout_blob` lays a model's weights out in ONE allocation (docs/ARCHITECTURE.md,
Decisions 2) as the model declares them (models/decoder.py weight_layout): q/k/v rows
fused into one matrix per layer, gate/up likewise, each entry 256-byte aligned. Entries
are bf16, or with FP8 weights the products' e4m3 codes and their float32 row scales
(docs/ARCHITECTURE.md, "FP8 weights"), read from an FP8 checkpoint or made from bf16
ones at load. The CUDA backend streams `iter_blob_pieces` into it and quantizes what
`quantized_entries` names; the NumPy backend uses `load_host_weights`.
"""
from __future__ import annotations

import json
import mmap
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Callable, Iterator, NamedTuple

import numpy as np

from .bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from .errors import CheckpointError
from .fp8 import e4m3_to_float32, quantize_rows
from .interface import Fp8Weight
from .util import cdiv

MAX_HEADER_BYTES = 100_000_000
BLOB_ALIGNMENT = 256
DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
_NUMPY_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8}
FP8_DTYPE = "F8_E4M3"  # only the products' weights of an FP8 checkpoint (open_checkpoint)
# Real safetensors dtypes that are valid files but not usable as weights here.
_UNSUPPORTED_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64",
                       "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}
_KNOWN = ", ".join(DTYPE_SIZES)
SCALE_SUFFIX = "_scale"        # an FP8 weight "...weight" has its scales in "...weight_scale"
INPUT_SCALE_SUFFIX = ".input_scale"  # static activation scales: not needed (bf16 activations)
_CORRUPT = "the file is corrupt or not safetensors; re-download or re-convert it"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl", ".pickle")
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # "BF16" | "F16" | "F32"
    shape: tuple[int, ...]
    path: Path
    start: int               # absolute byte offset of the data in the file
    nbytes: int


# --------------------------------------------------------------------------- header

def read_safetensors_header(path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; name -> TensorInfo."""
    path = Path(path)
    where = f"safetensors file {str(path)!r}"
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{where} is {file_size} bytes, shorter than the 8-byte "
                                      f"header length; {_CORRUPT}")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{where} declares a {header_len}-byte header, over the "
                                      f"{MAX_HEADER_BYTES}-byte limit; {_CORRUPT}")
            if 8 + header_len > file_size:
                raise CheckpointError(f"{where} declares a {header_len}-byte header but the file "
                                      f"is only {file_size} bytes; {_CORRUPT}")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}") from None

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: header is not valid UTF-8 (byte {e.start}); "
                              f"{_CORRUPT}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: header is not valid JSON ({e.msg} at char {e.pos}); "
                              f"{_CORRUPT}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: header JSON is nested too deeply; {_CORRUPT}") from None
    except _DuplicateKey as e:
        raise CheckpointError(f"{where}: header names {e.args[0]!r} twice; {_CORRUPT}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header is a JSON {type(header).__name__}, not an "
                              f"object; {_CORRUPT}")

    data_start = 8 + header_len
    ranges = {}   # name -> (dtype, shape, begin, end), offsets relative to the data section
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(where, entry)
            continue
        ranges[name] = _parse_entry(where, name, entry)

    _check_layout(where, ranges, data_len=file_size - data_start)
    tensors = {}
    for name, (dtype, shape, begin, end) in ranges.items():
        expected = _num_elements(shape) * DTYPE_SIZES[dtype]
        if expected != end - begin:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(shape)} of {dtype} ({expected} bytes) "
                f"but its byte range [{begin}, {end}] holds {end - begin} bytes; {_CORRUPT}")
        tensors[name] = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
    return tensors


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _check_metadata(where, metadata):
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings; {_CORRUPT}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(where, name, entry):
    what = f"{where}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{what} is described by a JSON {type(entry).__name__}, not an "
                              f"object; {_CORRUPT}")
    for field_name in ("dtype", "shape", "data_offsets"):
        if field_name not in entry:
            raise CheckpointError(f"{what} has no {field_name!r} field; {_CORRUPT}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype in _UNSUPPORTED_DTYPES:
        raise CheckpointError(f"{what} has dtype {dtype}, which is not supported for weights "
                              f"(supported: {_KNOWN}); convert the checkpoint to bf16")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{what} has unknown dtype {dtype!r} (known: {_KNOWN}); {_CORRUPT}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise CheckpointError(f"{what} has shape {shape!r}; a shape must be a list of "
                              f"non-negative integers; {_CORRUPT}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(n) and n >= 0 for n in offsets) or offsets[0] > offsets[1]):
        raise CheckpointError(f"{what} has data_offsets {offsets!r}; expected [begin, end] with "
                              f"0 <= begin <= end; {_CORRUPT}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(where, ranges, data_len: int):
    """Byte ranges must tile the data section: contiguous from 0 to the end of the file."""
    position, previous = 0, None
    for name, (_, _, begin, end) in sorted(ranges.items(), key=lambda kv: kv[1][2:]):
        if begin > position:
            gap = (f"starts at byte {begin}, leaving a gap of {begin - position} bytes after "
                   + (f"tensor {previous!r}" if previous else "the header (data must start at 0)"))
            raise CheckpointError(f"{where}: tensor {name!r} {gap}; {_CORRUPT}")
        if begin < position:
            raise CheckpointError(f"{where}: tensor {name!r} starts at byte {begin}, overlapping "
                                  f"tensor {previous!r} which ends at {position}; {_CORRUPT}")
        position, previous = end, name
    if position > data_len:
        raise CheckpointError(f"{where}: tensors need {position} bytes of data but the file holds "
                              f"{data_len}; the file is truncated; re-download it")
    if position < data_len:
        raise CheckpointError(f"{where}: {data_len - position} trailing bytes after the last "
                              f"tensor; {_CORRUPT}")


def _num_elements(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


# --------------------------------------------------------------------------- checkpoint

class Checkpoint:
    """Validated tensors of a model directory, read lazily through read-only mmaps."""

    def __init__(self, model_dir: Path, tensors: dict[str, TensorInfo]):
        self.model_dir = model_dir
        self.tensors = tensors
        self.source_dtypes = {info.dtype for info in tensors.values()}
        self._maps: dict[Path, mmap.mmap] = {}

    def read(self, name) -> np.ndarray:
        """Read-only view in the stored dtype (uint16 bits for BF16), shaped."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"no tensor {name!r} in the checkpoint")
        buffer = self._maps.get(info.path)
        if buffer is None:
            with open(info.path, "rb") as f:
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[info.path] = buffer
        count = info.nbytes // DTYPE_SIZES[info.dtype]
        if count == 0:
            return np.zeros(info.shape, dtype=_NUMPY_DTYPES[info.dtype])
        flat = np.frombuffer(buffer, dtype=_NUMPY_DTYPES[info.dtype], count=count,
                             offset=info.start)
        return flat.reshape(info.shape)

    def read_bf16(self, name) -> np.ndarray:
        """uint16 bf16 bits; BF16 tensors come back as the zero-copy read-only view."""
        array = self.read(name)
        if array.dtype == np.uint16:
            return array
        return float32_to_bf16_bits(array.astype(np.float32))

    def read_float32(self, name) -> np.ndarray:
        array = self.read(name)
        if array.dtype == np.uint16:
            return bf16_bits_to_float32(array)
        return array.astype(np.float32)   # always a copy

    def read_scales(self, name) -> np.ndarray:
        """An FP8 weight's scales ("...weight_scale") as float32, one per row of the weight:
        a per-channel [N, 1] or [N] tensor as it is, a per-tensor one repeated."""
        rows = self.tensors[name.removesuffix(SCALE_SUFFIX)].shape[0]
        scales = self.read_float32(name).reshape(-1)
        if scales.size == 1:
            return np.full(rows, scales[0], np.float32)
        return np.ascontiguousarray(scales, dtype=np.float32)

    def close(self):
        maps, self._maps = self._maps, {}
        for buffer in maps.values():
            try:
                buffer.close()
            except BufferError:
                pass   # views are still alive; the map closes when the last one goes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(model_dir, model, log: Callable[[str], None] | None = None) -> Checkpoint:
    """Find, parse and validate the weights of a model directory against what the model
    (a models/ Decoder) reads: its tensor_shapes(), and its config."""
    config = model.config
    model_dir = Path(model_dir)
    found = find_weights(model_dir)
    tensors = read_safetensors_header(found) if found.name == SINGLE_FILE else \
        _read_sharded(model_dir)
    where = str(found)

    tensors = model.checkpoint_names(tensors)
    tensors = {n: t for n, t in tensors.items() if not n.endswith(_IGNORED_SUFFIX)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)   # tied: the LM head reads embed_tokens
    if config.checkpoint_quantization:  # static activation scales: the activations stay bf16
        tensors = {n: t for n, t in tensors.items() if not n.endswith(INPUT_SCALE_SUFFIX)}
    fp8_found = sorted((n for n, t in tensors.items() if t.dtype == FP8_DTYPE), key=_natural_key)
    if fp8_found and not config.checkpoint_quantization:
        raise CheckpointError(
            f"{where}: tensor {fp8_found[0]!r} is FP8 (F8_E4M3), which only the projections "
            "of a checkpoint with a compressed-tensors quantization_config in config.json may "
            "be; put the checkpoint's quantization_config back into config.json")
    expected = model.tensor_shapes()
    _check_names(where, expected, tensors, config)
    for name, shape in expected.items():
        found = tensors[name].shape
        if found != shape and not (name.endswith(SCALE_SUFFIX) and found in _scale_shapes(shape)):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(found)}, config.json expects "
                f"{list(shape)}; make sure config.json belongs to these weights")
    fp8 = set(model.fp8_tensors()) if config.checkpoint_quantization else set()
    for name in expected:
        dtype = tensors[name].dtype
        if name in fp8 and dtype != FP8_DTYPE:
            raise CheckpointError(
                f"{where}: tensor {name!r} is {dtype} but config.json's quantization_config "
                "makes every projection FP8 (F8_E4M3); checkpoints that mix formats are not "
                "supported")
        if name not in fp8 and dtype == FP8_DTYPE:
            raise CheckpointError(
                f"{where}: tensor {name!r} is FP8 (F8_E4M3); only the projections' weights "
                "may be (embeddings, norms and the LM head stay bf16)")
    tensors = {name: tensors[name] for name in expected}
    converted = sorted({t.dtype for n, t in tensors.items()
                        if n not in fp8 and not n.endswith(SCALE_SUFFIX)} - {"BF16"})
    if converted and log is not None:
        log(f"converting {', '.join(converted)} weights to bf16 at load")
    return Checkpoint(model_dir, tensors)


def find_weights(model_dir) -> Path:
    """The file that says where a model folder's weights are: model.safetensors, else the
    shards' index. A CheckpointError naming what the folder holds instead, found before
    anything is read (the CLI checks it with config.json, before the model loads)."""
    model_dir = Path(model_dir)
    for name in (SINGLE_FILE, INDEX_FILE):
        if (model_dir / name).is_file():
            return model_dir / name
    raise CheckpointError(_no_weights_message(model_dir))


def _scale_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The shapes an FP8 weight's scales may have on disk besides [N, 1]: [N], or one
    scale for the whole tensor ([1], [1, 1] or a scalar)."""
    return ((shape[0],), (1,), (1, 1), ())


def _no_weights_message(model_dir: Path) -> str:
    if not model_dir.is_dir():
        return (f"model directory {str(model_dir)!r} does not exist; pass the path of a "
                "Hugging Face model folder")
    names = sorted(p.name for p in model_dir.iterdir())
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
    loose = [n for n in names if n.endswith(".safetensors")]
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if ggufs and not (pickles or loose):
        return (f"no weights in {str(model_dir)!r}: looked for {SINGLE_FILE} and {INDEX_FILE}; "
                f"found {', '.join(ggufs[:4])}, GGUF (llama.cpp's format), which cupy-llama "
                "does not load: use the model's Hugging Face release (.safetensors weights)")
    looked = f"no weights in {str(model_dir)!r}: looked for {SINGLE_FILE} and {INDEX_FILE}"
    if loose and not pickles:
        if "consolidated.safetensors" in loose:  # with params.json: Mistral's own layout
            return (f"{looked}; found consolidated.safetensors, Mistral's own layout, whose "
                    "tensor names are not Hugging Face's: download the model's Hugging Face "
                    "files (its model*.safetensors and config.json)")
        return (f"{looked}; found {', '.join(loose[:4])} but no {INDEX_FILE} to say which "
                f"tensors they hold; name a single file {SINGLE_FILE}, or add the index "
                "that names each shard's tensors")
    found = f"; found {', '.join(pickles[:4])}" if pickles else ""
    return (f"{looked}{found}; pickle checkpoints (.bin/.pth) are refused because loading "
            "them can run code: convert the model to safetensors")


def _read_sharded(model_dir: Path) -> dict[str, TensorInfo]:
    index_path = model_dir / INDEX_FILE
    where = f"index {str(index_path)!r}"
    try:
        index = json.loads(index_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} cannot be read as JSON ({e}); re-download it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{where} needs a 'weight_map' object from tensor name to shard "
                              "file name; re-download it")

    shard_headers: dict[str, dict[str, TensorInfo]] = {}
    for shard_name in dict.fromkeys(weight_map.values()):
        shard_headers[shard_name] = read_safetensors_header(
            _shard_path(where, model_dir, shard_name))
    tensors: dict[str, TensorInfo] = {}
    for name, shard_name in weight_map.items():
        info = shard_headers[shard_name].get(name)
        if info is None:
            raise CheckpointError(f"{where} puts tensor {name!r} in {shard_name!r} but that shard "
                                  "does not hold it; re-download the model")
        tensors[name] = info
    for shard_name, header in shard_headers.items():
        for name in header:
            if weight_map.get(name) != shard_name and not name.endswith(_IGNORED_SUFFIX):
                listed = weight_map.get(name)
                elsewhere = f"lists it in {listed!r}" if listed else "does not list it"
                raise CheckpointError(f"shard {shard_name!r} holds tensor {name!r} but {where} "
                                      f"{elsewhere}; re-download the model")
    return tensors


def _shard_path(where, model_dir: Path, shard_name: str) -> Path:
    """A shard must be a file inside the model directory (no escaping through the index)."""
    parts = PurePosixPath(shard_name.replace("\\", "/")).parts
    if (not shard_name or PurePosixPath(shard_name).is_absolute()
            or PureWindowsPath(shard_name).is_absolute() or PureWindowsPath(shard_name).drive
            or ".." in parts):
        raise CheckpointError(f"{where} names shard {shard_name!r}, a path outside the model "
                              "directory; shard names must be plain file names inside it")
    path = model_dir / shard_name
    target = path.resolve()
    if not any(target.is_relative_to(root) for root in _allowed_roots(model_dir)):
        raise CheckpointError(f"{where} names shard {shard_name!r}, which resolves to "
                              f"{str(target)!r} outside the model directory; copy the file into it")
    if not target.is_file():
        raise CheckpointError(f"{where} names shard {shard_name!r} but {str(path)!r} does not "
                              "exist; download the missing shard")
    return path


def _allowed_roots(model_dir: Path) -> list[Path]:
    root = model_dir.resolve()
    roots = [root]
    # A Hugging Face hub cache keeps files in <repo>/blobs and links them from
    # <repo>/snapshots/<revision>/: links into that repository's blobs stay allowed.
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _check_names(where, expected: dict, tensors: dict, config):
    missing = [name for name in expected if name not in tensors]
    unexpected = sorted((name for name in tensors if name not in expected), key=_natural_key)
    if not missing and not unexpected:
        return
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_name_list(unexpected)}")
    hint = "make sure config.json belongs to these weights"
    if missing == ["lm_head.weight"] and not unexpected:
        hint = "set tie_word_embeddings to true in config.json if the model ties its LM head"
    raise CheckpointError(
        f"{where} does not match config.json ({config.num_hidden_layers} layers): "
        f"{'; '.join(problems)}; {hint}")


def _name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# --------------------------------------------------------------------------- the weight blob

# the blob's entry formats and their bytes per element
BLOB_DTYPES = {"bf16": 2, "e4m3": 1, "f32": 4}


class LayoutItem(NamedTuple):
    """One entry of a model's weight layout (models/decoder.py weight_layout)."""
    key: str                  # internal name: "embed", "layers.{i}.qkv", ...
    sources: tuple[str, ...]  # checkpoint tensors laid side by side along dim 0, in order
    shape: tuple[int, ...]    # of the (possibly fused) tensor
    dtype: str = "bf16"       # "bf16", "e4m3" (FP8 codes) or "f32" (an FP8 entry's scales)
    quantize: bool = False    # FP8 codes and scales made at load from bf16 `sources`


@dataclass(frozen=True)
class BlobEntry:
    key: str                  # internal name: "embed", "layers.{i}.qkv", ...
    offset: int               # byte offset in the blob, BLOB_ALIGNMENT-aligned
    shape: tuple[int, ...]    # of the (possibly fused) tensor
    sources: tuple[str, ...]  # checkpoint tensor names concatenated along dim 0, in order
    dtype: str = "bf16"       # see LayoutItem
    quantize: bool = False

    @property
    def nbytes(self) -> int:
        return _num_elements(self.shape) * BLOB_DTYPES[self.dtype]


def scale_key(key: str) -> str:
    """The blob key of an FP8 entry's row scales."""
    return key + ".scale"


def layout_blob(layout: list[LayoutItem]) -> tuple[dict[str, BlobEntry], int]:
    """The blob of a model's weight layout (in blob order; models/decoder.py
    weight_layout): entries by key in blob order, each BLOB_ALIGNMENT-aligned, and the
    blob's size in bytes."""
    plan, offset = {}, 0
    for item in layout:
        entry = BlobEntry(item.key, offset, tuple(item.shape), tuple(item.sources), item.dtype,
                          item.quantize)
        plan[item.key] = entry
        offset = _align(offset + entry.nbytes)
    return plan, offset


def _align(n: int) -> int:
    return cdiv(n, BLOB_ALIGNMENT) * BLOB_ALIGNMENT


def _read_piece(checkpoint: Checkpoint, entry: BlobEntry, name: str) -> np.ndarray:
    """One source tensor of an entry in the entry's format: bf16 bits, e4m3 codes as they
    are stored, or an FP8 weight's scales as float32, one per row."""
    if entry.dtype == "e4m3":
        return checkpoint.read(name)
    if entry.dtype == "f32":
        return checkpoint.read_scales(name)
    return checkpoint.read_bf16(name)


def quantized_entries(plan: dict[str, BlobEntry]) -> list[tuple[BlobEntry, BlobEntry]]:
    """(codes entry, scales entry) of each FP8 entry to be made from bf16 sources at load."""
    return [(entry, plan[scale_key(entry.key)]) for entry in plan.values()
            if entry.quantize and entry.dtype == "e4m3"]


def iter_blob_pieces(checkpoint: Checkpoint,
                     plan: dict[str, BlobEntry]) -> Iterator[tuple[int, np.ndarray]]:
    """(blob byte offset, contiguous array), one per source tensor, in offset order; the
    entries quantized at load (quantized_entries) are not among them."""
    for entry in sorted(plan.values(), key=lambda e: e.offset):
        if entry.quantize:
            continue
        offset = entry.offset
        for name in entry.sources:
            piece = np.ascontiguousarray(_read_piece(checkpoint, entry, name))
            yield offset, piece
            offset += piece.nbytes
        if offset != entry.offset + entry.nbytes:
            raise CheckpointError(f"blob entry {entry.key!r} expects {entry.nbytes} bytes but its "
                                  f"tensors hold {offset - entry.offset}; the checkpoint was "
                                  "opened with a different config")


def load_host_weights(checkpoint: Checkpoint, plan: dict[str, BlobEntry],
                      dtype=np.float32) -> dict:
    """key -> array of the entry's shape, fused like the blob; an FP8 entry -> an
    Fp8Weight of its codes' values (in `dtype`) and its float32 scales.

    Values are the weights the engine runs on (F16/F32 checkpoints are rounded to bf16
    first, and bf16 ones quantized to FP8 where the plan says, as on the GPU), so both
    backends compute with the same numbers."""
    weights = {}
    for key, entry in plan.items():
        if entry.dtype == "f32":
            continue  # an FP8 entry's scales: with its codes
        if entry.dtype == "e4m3":
            scales = plan[scale_key(key)]
            if entry.quantize:
                codes, scale = quantize_rows(_fused(key, entry, [
                    bf16_bits_to_float32(checkpoint.read_bf16(name)) for name in entry.sources]))
            else:
                codes = _fused(key, entry, [checkpoint.read(name) for name in entry.sources])
                scale = np.concatenate([checkpoint.read_scales(name) for name in scales.sources])
            weights[key] = Fp8Weight(e4m3_to_float32(codes).astype(dtype, copy=False), scale)
            continue
        fused = _fused(key, entry, [bf16_bits_to_float32(checkpoint.read_bf16(name))
                                    for name in entry.sources])
        weights[key] = fused.astype(dtype, copy=False)
    return weights


def _fused(key: str, entry: BlobEntry, parts: list[np.ndarray]) -> np.ndarray:
    fused = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if fused.shape != entry.shape:
        raise CheckpointError(f"blob entry {key!r} expects shape {list(entry.shape)} but its "
                              f"tensors give {list(fused.shape)}; the checkpoint was opened "
                              "with a different config")
    return fused

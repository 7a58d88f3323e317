"""Writing safetensors files (test models, the demo model). Reading and validation live in
weights.py. Arrays of dtype uint16 are written as BF16 bits, and uint8 ones as U8, unless
`dtypes` names another dtype of the same size for them (F8_E4M3: FP8 codes)."""
import json
import os
from pathlib import Path

import numpy as np

_NUMPY_TO_SAFETENSORS = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.uint16): "BF16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8",
}
_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}


def write_safetensors(path, tensors: dict, metadata: dict | None = None,
                      dtypes: dict | None = None) -> None:
    """tensors: name -> numpy array (uint16 means bf16 bits). Written in insertion order.
    dtypes: name -> safetensors dtype for some of them (the array's bytes as they are)."""
    header = {}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = (dtypes or {}).get(name) or _NUMPY_TO_SAFETENSORS.get(array.dtype)
        if dtype is None or _SIZES.get(dtype) != array.dtype.itemsize:
            raise ValueError(f"cannot write tensor {name!r} of numpy dtype {array.dtype} as {dtype}")
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # align the data section to 8 bytes
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for array in arrays:
            f.write(array.tobytes())
    os.replace(tmp, path)

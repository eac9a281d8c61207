"""One pass over a GGUF file: its metadata and its tensor table, each
tensor's bytes a view of one memory map (nothing de-quantised yet).

Why not the readers at hand: the ``gguf`` package's ``GGUFReader`` wraps
every element of every metadata array in numpy views, so the 49,152-token
vocabulary and 48,900 merges of SmolLM2 cost about 10 s a parse, and
transformers' GGUF path parsed the file three times (config, tokenizer,
weights). This walks the file once with :mod:`struct` (about 0.4 s for
SmolLM2, the string arrays included) and leaves de-quantising to
``gguf.quants`` tensor by tensor.

The format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, v2
and v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; metadata as (string key, u32 type, value); the tensor table
as (string name, u32 dims, u64 x dims fastest-moving first, u32 ggml type,
u64 offset); the tensor data from the next ``general.alignment`` boundary
(default 32). Strings are a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megac.errors import MegacError

_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
#: fixed-width metadata value types: struct format and numpy dtype
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
#: ggml types stored as plain values (the others are quantised blocks, kept as bytes)
_VALUE_TYPES = {0: np.float32, 1: np.float16}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    #: torch order (slowest-moving first), in elements
    shape: tuple[int, ...]
    ggml_type: int
    #: values for F32/F16; for quantised types uint8 blocks shaped (*shape[:-1], bytes per row)
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Reads little-endian values from a byte buffer, advancing as it goes."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise MegacError(f"{self.path}: truncated GGUF file (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise MegacError(f"{self.path}: truncated GGUF file (a string at byte {self.pos})")
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MegacError(f"{self.path}: a GGUF string at byte {self.pos - n} is not UTF-8") from None

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<IQ")
            if elem in _SCALARS:  # numbers in one go (token types, scores)
                dtype = np.dtype(_SCALARS[elem][1]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise MegacError(f"{self.path}: truncated GGUF file (an array at byte {self.pos})")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(elem) for _ in range(count)]
        raise MegacError(f"{self.path}: GGUF metadata value type {kind} at byte {self.pos} is unknown")


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata (arrays as lists) and tensors (memory-mapped) of the GGUF at ``path``."""
    path = Path(path)
    try:
        buf = np.memmap(path, mode="r", dtype=np.uint8)
    except (OSError, ValueError) as err:
        raise MegacError(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise MegacError(f"{path}: not a GGUF file")
    cur.pos = 4
    version, tensor_count, kv_count = cur.unpack("<IQQ")
    if version not in _VERSIONS:
        raise MegacError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    metadata = {}
    for _ in range(kv_count):
        key = cur.string()
        (kind,) = cur.unpack("<I")
        metadata[key] = cur.value(kind)
    table = []
    for _ in range(tensor_count):
        name = cur.string()
        (ndims,) = cur.unpack("<I")
        dims = cur.unpack(f"<{ndims}Q")
        ggml_type, offset = cur.unpack("<IQ")
        table.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors = {name: _tensor(buf, path, name, shape, ggml_type, start + offset)
               for name, shape, ggml_type, offset in table}
    return GGUFFile(path, metadata, tensors)


def _tensor(buf, path: Path, name: str, shape: tuple[int, ...], ggml_type: int, at: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise MegacError(f"{path}: tensor {name}: ggml type {ggml_type} is unknown") from None
    if ggml_type in _VALUE_TYPES:
        dtype, data_shape = np.dtype(_VALUE_TYPES[ggml_type]), shape
    else:
        if shape[-1] % block:
            raise MegacError(f"{path}: tensor {name}: rows of {shape[-1]} are not whole {qtype.name} blocks")
        dtype, data_shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * block_bytes)
    count = int(np.prod(data_shape))
    if at + count * dtype.itemsize > len(buf):
        raise MegacError(f"{path}: tensor {name}: its data runs past the end of the file")
    data = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(data_shape)
    return GGUFTensor(name, shape, ggml_type, data)


__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]

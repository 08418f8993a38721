"""Safetensors files read by slices: the one checkpoint reader of `hf_checkpoint` (and `peft`'s tests).

    files = SafetensorsFiles([path / "model-00001-of-00002.safetensors", ...])
    entry = files.entries["model.layers.0.mlp.down_proj.weight"]    # file, dtype, shape
    x = files.read(entry, (slice(0, 128), slice(None)))             # rows 0-127 only

A file's header (its first 8 + n bytes) says where each tensor's bytes are; `read` maps only the
tensor's range of the file, copies the slice out and unmaps it, so what a process holds is the
slices it asked for and never the file: safetensors' own reader maps the whole file and keeps
every page a strided slice touches mapped while it is open (a column slice of a tensor counts the
whole tensor against the process). `requested` counts the bytes of the slices read. A file whose
header is damaged, or which holds fewer bytes than its header describes (a truncated download),
is refused before any tensor is read, naming it.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
          "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
          "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
          "BOOL": np.dtype(np.bool_)}


class DamagedFile(ValueError):
    """A safetensors file whose header cannot be read or whose data is shorter than its header says."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: its file, name, dtype (as safetensors names it), shape and offset."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def read_header(file: Path, fix: str = "download it again") -> list[Entry]:
    """The tensors of safetensors `file`, in header order; a damaged or truncated file raises `DamagedFile`
    (its message ends with `fix`)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        entries, end = [], 0
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            begin, stop = spec["data_offsets"]
            entry = Entry(file, name, spec["dtype"], tuple(spec["shape"]), 8 + n + begin)
            if spec["dtype"] not in DTYPES or stop - begin != entry.nbytes:
                raise ValueError(f"tensor {name}: dtype {spec['dtype']} of shape {spec['shape']} in {stop - begin} bytes")
            entries.append(entry)
            end = max(end, 8 + n + stop)
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFile(f"{file}: not a readable safetensors file ({e}): the file is damaged; {fix}") from None
    if end > size:
        raise DamagedFile(f"{file}: truncated: its header describes {end:,} bytes, the file holds {size:,}: {fix}")
    return entries


class SafetensorsFiles:
    """The tensors of a set of safetensors files, by name (the first file holding a name wins), read by slices."""

    def __init__(self, files: list[Path], fix: str = "download it again"):
        self.headers = {file: read_header(file, fix) for file in files}
        self.entries: dict[str, Entry] = {}
        for entries in self.headers.values():
            for entry in entries:
                self.entries.setdefault(entry.name, entry)
        self.requested = 0  # bytes of the slices read

    def read(self, entry: Entry, index: tuple[slice, ...] = ()) -> np.ndarray:
        """Slice `index` (of slices, one per leading axis; the rest whole) of tensor `entry`, copied out."""
        dtype = DTYPES[entry.dtype]
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, entry.shape)) + entry.shape[len(index):]
        if math.prod(shape) == 0 or entry.nbytes == 0:
            return np.zeros(shape, dtype)
        start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        with open(entry.file, "rb") as f, mmap.mmap(f.fileno(), entry.offset + entry.nbytes - start, offset=start,
                                                     access=mmap.ACCESS_READ) as mapped:
            whole = np.frombuffer(mapped, dtype, math.prod(entry.shape), entry.offset - start).reshape(entry.shape)
            out = np.array(whole[index])
            del whole  # released before the mapping closes
        self.requested += out.nbytes
        return out

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> np.ndarray:
        """Tensor `name`, whole."""
        return self.read(self.entries[name])


def normalised(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` with a concrete start and stop on every axis of `shape` (step 1)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"slices are read with step 1, not {step}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)



def dtype_name(dtype) -> str:
    """The safetensors name of a numpy dtype (`F32`, `BF16`, ...)."""
    return next(name for name, d in DTYPES.items() if d == np.dtype(dtype))


class SafetensorsWriter:
    """One safetensors file written a tensor at a time: the header (every tensor's name, dtype and
    shape, known before any data) first, then each tensor's bytes as it comes, so the writer holds one
    tensor, never the file. Written under a hidden name and renamed when complete."""

    def __init__(self, file: Path, tensors: dict[str, tuple[tuple[int, ...], str]]):
        self.file, self.partial = file, file.with_name(f".{file.name}.partial")
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, (shape, dtype) in tensors.items():
            size = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.expected = [(name, tuple(shape), dtype) for name, (shape, dtype) in tensors.items()]
        self.f = open(self.partial, "wb")
        self.f.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, x: np.ndarray) -> None:
        want = self.expected.pop(0)
        if want != (name, x.shape, dtype_name(x.dtype)):
            raise AssertionError(f"{self.file}: wrote {name} {x.shape} {x.dtype} where the header has {want}")
        self.f.write(memoryview(np.ascontiguousarray(x).view(np.uint8)))  # no copy of a contiguous tensor

    def close(self) -> None:
        assert not self.expected, f"{self.file}: tensors never written: {self.expected}"
        self.f.close()
        self.partial.rename(self.file)

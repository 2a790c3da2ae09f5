"""Reading a GGUF file: its metadata and tensor table (without materializing the large
array fields), split files as one, and typed access to the fields (used by
``gguf_metadata``, ``gguf_weights`` and ``gguf_tokenizer``)."""

from __future__ import annotations

import re
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError


def open_reader(gguf_path: Path) -> Any:
    """Open ``gguf_path`` with :class:`gguf.GGUFReader` (memory-mapped, read-only)."""
    from gguf import GGUFReader

    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf file")
    try:
        return GGUFReader(gguf_path, "r")
    except Exception as exc:  # gguf raises ValueError, OSError, struct errors, ...
        raise ModelLoadError(
            f"{gguf_path} is not a readable GGUF file ({exc}); re-download or re-export it"
        ) from exc


# Numeric arrays up to this long (per-layer values: a sliding-window pattern, head counts)
# are read with the header (``array_field``); longer ones (token scores) are skipped over.
_SMALL_ARRAY = 4096


@dataclass
class _Field:
    """The attributes of ``gguf.ReaderField`` that :func:`field` and :func:`token_count` read.
    An array keeps only its length (``data`` is a range): its elements are skipped."""

    types: list[Any]
    parts: list[np.ndarray]
    data: Sequence[int]


@dataclass
class _Tensor:
    """The attributes of ``gguf.ReaderTensor`` that the block reader uses."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the fastest-varying dimension first
    data: np.ndarray | None  # memory-mapped; quantized types as bytes, as gguf.GGUFReader
    # maps them; None where the type is unknown or the file ends before the tensor does
    offset: int = 0  # from the start of the data section


class _Unsupported(Exception):
    """A file this reader leaves to gguf.GGUFReader (big-endian, nested arrays, ...)."""


class HeaderReader:
    """A GGUF file's metadata and tensor table, read the way :class:`gguf.GGUFReader` reads
    them but without materializing array fields: the tokenizer's vocabulary and merges
    (~100,000 strings for SmolLM2) are skipped over, where GGUFReader builds a numpy view of
    every element (3.7-5.7 s of every engine start on the reference machine, against 0.2 s
    here). Little-endian files only, as the host (GGUFReader reads the others). For the block reader (``read_gguf_blocks``), which needs the config fields and the
    tensors. The array fields named in ``arrays`` are read into ``self.arrays`` (strings
    decoded as UTF-8, numbers as Python numbers): the tokenizer's vocabulary, for the
    converter."""

    def __init__(self, path: Path, arrays: Collection[str] = ()) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
        from gguf.gguf_reader import GGUFReader
        from gguf.quants import quant_shape_to_byte_shape

        scalars = GGUFReader.gguf_scalar_to_np  # fixed-size value types, as numpy types

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string() -> bytes:
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(buf[pos - n:pos])

        if take("<I") != 0x46554747:  # b"GGUF"
            raise _Unsupported("not a GGUF file")
        version = take("<I")
        if version not in (2, 3):
            raise _Unsupported(f"version {version}")
        tensor_count, kv_count = take("<Q"), take("<Q")
        self.fields: dict[str, _Field] = {}
        self.arrays: dict[str, list[Any]] = {}
        for _ in range(kv_count):
            key = string().decode("utf-8")
            kind = GGUFValueType(take("<I"))
            if kind == GGUFValueType.STRING:
                n = take("<Q")
                part = np.frombuffer(buf, np.uint8, count=n, offset=pos)
                pos += n
                self.fields[key] = _Field([kind], [part], [0])
            elif kind in scalars:
                part = np.frombuffer(buf, scalars[kind], count=1, offset=pos)
                pos += part.nbytes
                self.fields[key] = _Field([kind], [part], [0])
            elif kind == GGUFValueType.ARRAY:
                item, count = GGUFValueType(take("<I")), take("<Q")
                if key in arrays or (item in scalars and count <= _SMALL_ARRAY):
                    self.arrays[key] = _array_values(buf, pos, item, count)
                if item == GGUFValueType.STRING:
                    for _ in range(count):
                        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                elif item in scalars:
                    pos += count * np.dtype(scalars[item]).itemsize
                else:
                    raise _Unsupported(f"array of {item.name} in {key}")
                self.fields[key] = _Field([kind, item], [], range(count))
            else:
                raise _Unsupported(f"value type {kind.name} in {key}")
        infos = []
        for _ in range(tensor_count):
            name = string().decode("utf-8")
            dims = np.array([take("<Q") for _ in range(take("<I"))], dtype=np.uint64)
            infos.append((name, dims, take("<I"), take("<Q")))
        alignment = 32
        if "general.alignment" in self.fields:
            alignment = int(self.fields["general.alignment"].parts[0][0])
        start = (pos + alignment - 1) // alignment * alignment
        self.tensors: list[_Tensor] = []
        self.file_size = len(buf)
        self.data_start = start
        # the types GGUFReader maps as numbers; the others (quantized, bf16) as bytes
        items = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        for name, dims, raw_type, offset in infos:
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            n_elements = int(np.prod(dims))
            # A type gguf-py does not know, or bytes past the end of the file: the tensor
            # is listed without data, and the weights reader names it (check_tensors).
            try:
                ggml_type: Any = GGMLQuantizationType(raw_type)
                block, size = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                self.tensors.append(_Tensor(name, raw_type, dims, None, offset))
                continue
            nbytes = n_elements * size // block
            if start + offset + nbytes > len(buf) or int(dims[0]) % block:
                self.tensors.append(_Tensor(name, ggml_type, dims, None, offset))
                continue
            if ggml_type in items:
                data = np.frombuffer(buf, items[ggml_type], count=n_elements,
                                     offset=start + offset).reshape(shape)
            else:
                data = np.frombuffer(buf, np.uint8, count=nbytes,
                                     offset=start + offset).reshape(
                    quant_shape_to_byte_shape(shape, ggml_type))
            self.tensors.append(_Tensor(name, ggml_type, dims, data, offset))


def _array_values(buf: memoryview, pos: int, item: Any, count: int) -> list[Any]:
    """The ``count`` elements of type ``item`` of the array whose first element starts at
    byte ``pos`` of ``buf``; raises :class:`_Unsupported` for arrays of arrays."""
    from gguf import GGUFValueType
    from gguf.gguf_reader import GGUFReader

    if item == GGUFValueType.STRING:
        values = []
        for _ in range(count):
            n = struct.unpack_from("<Q", buf, pos)[0]
            values.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace"))
            pos += 8 + n
        return values
    if item not in GGUFReader.gguf_scalar_to_np:
        raise _Unsupported(f"array of {item.name}")
    return np.frombuffer(buf, GGUFReader.gguf_scalar_to_np[item], count=count,
                         offset=pos).tolist()


def open_header(gguf_path: Path) -> Any:
    """The metadata and tensors of ``gguf_path`` without its array fields' elements
    (:class:`HeaderReader`); files it does not handle, or cannot open, go to
    :func:`open_reader`, which reads them all or says why it cannot.

    A split GGUF (``split.count`` > 1: llama.cpp's ``gguf-split`` shards, as Qwen's own GGUF
    repositories ship them) is read from its first shard's path, as llama.cpp reads it: the
    metadata is the first shard's, the tensors are every shard's (:class:`SplitReader`)."""
    reader = _open_one(gguf_path)
    count = int(field(reader, "split.count", 1))
    return reader if count <= 1 else SplitReader(gguf_path, reader, count)


def _open_one(gguf_path: Path) -> Any:
    try:
        return HeaderReader(gguf_path)
    except (_Unsupported, OSError, ValueError, KeyError, IndexError, struct.error):
        return open_reader(gguf_path)


class SplitReader:
    """A split GGUF's shards as one reader: ``fields`` the first shard's (llama.cpp's
    ``gguf-split`` writes the metadata there), ``tensors`` every shard's in order, ``shards``
    the ``(path, reader)`` of each. The shards are found next to the first as
    ``gguf-split`` names them (``{prefix}-{i:05d}-of-{count:05d}.gguf``); a missing shard,
    one whose ``split.no`` is not its place, a tensor in two shards or a tensor count other
    than ``split.tensors.count`` is a :class:`ModelLoadError` naming the file, as llama.cpp
    refuses them (``llama_model_loader``)."""

    def __init__(self, first_path: Path, first: Any, count: int) -> None:
        number = int(field(first, "split.no", 0))
        postfix = f"-{number + 1:05d}-of-{count:05d}.gguf"
        if not first_path.name.endswith(postfix):
            raise ModelLoadError(
                f"{first_path} is shard {number + 1} of a {count}-shard split GGUF but is not "
                f"named like one (…{postfix}); keep the names llama.cpp's gguf-split gave "
                "the shards")
        prefix = first_path.name[:-len(postfix)]
        if number != 0:
            raise ModelLoadError(
                f"{first_path} is shard {number + 1} of a {count}-shard split GGUF; pass the "
                f"first shard, {prefix}-00001-of-{count:05d}.gguf (the others are read "
                "with it)")
        self.fields = first.fields
        self.arrays = getattr(first, "arrays", {})
        self.shards: list[tuple[Path, Any]] = [(first_path, first)]
        for i in range(1, count):
            path = first_path.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf")
            if not path.is_file():
                raise ModelLoadError(
                    f"{first_path} is the first of {count} shards of a split GGUF and shard "
                    f"{path.name} is missing; download every shard into {path.parent}")
            shard = _open_one(path)
            if field(shard, "split.no") != i:
                raise ModelLoadError(f"{path} is not shard {i + 1} of {first_path}'s split "
                                     f"GGUF (its split.no is {field(shard, 'split.no')})")
            self.shards.append((path, shard))
        self.tensors = [t for _, shard in self.shards for t in shard.tensors]
        names: set[str] = set()
        for path, shard in self.shards:
            for t in shard.tensors:
                if t.name in names:
                    raise ModelLoadError(f"GGUF tensor {t.name!r} is in two shards of "
                                         f"{first_path}'s split GGUF (again in {path.name})")
                names.add(t.name)
        expected = field(first, "split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise ModelLoadError(
                f"{first_path}'s split GGUF should hold {int(expected)} tensors but its "
                f"{count} shards hold {len(self.tensors)}; re-download the shards")


def file_bytes(gguf_path: Path) -> int:
    """The bytes of the GGUF file ``gguf_path``: of every shard where it is the first of a
    split file (``{prefix}-00001-of-0000N.gguf``, the shards beside it), for the memory the
    model's weights will take (they are laid out from the file, byte for byte or nearly)."""
    match = re.fullmatch(r"(.+)-00001-of-(\d{5})\.gguf", gguf_path.name)
    if match is None:
        return gguf_path.stat().st_size
    prefix, count = match.group(1), int(match.group(2))
    shards = [gguf_path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf")
              for i in range(1, count + 1)]
    return sum(shard.stat().st_size for shard in shards if shard.is_file())


def read_arrays(gguf_path: Path, keys: Collection[str]) -> dict[str, list[Any]]:
    """The array fields ``keys`` of ``gguf_path`` that it has, as lists (strings decoded as
    UTF-8), read by :class:`HeaderReader` or, for the files it leaves, gguf-py."""
    try:
        return HeaderReader(gguf_path, arrays=keys).arrays
    except (_Unsupported, OSError, ValueError, KeyError, IndexError, struct.error):
        fields = open_reader(gguf_path).fields
        return {key: list(fields[key].contents()) for key in keys if key in fields}


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Return the scalar or string value of metadata field ``key``, or ``default`` if absent.

    Array-valued fields raise :class:`ModelLoadError`.

    A GGUF field stores its value in ``field.parts[field.data[0]]``: a uint8 array holding the
    UTF-8 bytes for strings, or a one-element numpy array for numbers and booleans.
    """
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise ModelLoadError(
            f"GGUF metadata {key!r} is an array (per-layer values?); this converter only "
            "handles plain llama models with one value per key"
        )
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def array_field(reader: Any, key: str) -> list[Any] | None:
    """The elements of numeric array field ``key`` (per-layer values), ``None`` if the file
    has no such key or it holds one value (``field`` reads that)."""
    from gguf import GGUFValueType

    found = reader.fields.get(key)
    if found is None or found.types[0] != GGUFValueType.ARRAY:
        return None
    arrays = getattr(reader, "arrays", None)
    if arrays is not None and key in arrays:
        return list(arrays[key])
    if hasattr(found, "contents"):  # (gguf.GGUFReader's field)
        return list(found.contents())
    raise ModelLoadError(f"GGUF metadata {key!r} is an array of {len(found.data)} values, "
                         "too long to be per-layer values")


def require(reader: Any, key: str) -> Any:
    """Return metadata field ``key``; raise :class:`ModelLoadError` if it is missing."""
    value = field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}; re-export the model with llama.cpp")
    return value


def token_count(reader: Any) -> int:
    """Number of entries of ``tokenizer.ggml.tokens`` (0 if the file has no vocabulary)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    return 0 if field is None else len(field.data)

"""Reading a GGUF file's metadata: the reader, typed fields, and the Hugging Face config
and generation config they describe (used by ``freetoken_core.models.gguf``)."""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freetoken_core.errors import ModelLoadError

ARCH = "llama"


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
                if key in arrays:
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


# general.architecture -> the Hugging Face class FreeToken builds for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
}


def architecture(reader: Any) -> str:
    """The file's ``general.architecture``, checked against :data:`ARCHITECTURES`."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; FreeToken runs GGUF files of "
            f"{', '.join(sorted(ARCHITECTURES))}")
    return str(arch)


def rope_scaling(reader: Any, arch: str = ARCH) -> dict[str, Any] | None:
    """Map ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``) to ``rope_scaling``."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and field(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", field(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is None:  # llama.cpp's n_ctx_orig_yarn: the trained length
        original = field(reader, f"{arch}.context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = field(reader, f"{arch}.rope.scaling.attn_factor")
    if kind == "yarn" and attn_factor is not None:
        # llama.cpp: YaRN's 0.1 ln(factor) + 1, times the file's attention factor
        scaling["attention_factor"] = float(attn_factor) * (
            0.1 * math.log(float(factor)) + 1.0 if float(factor) > 1 else 1.0)
    return scaling


# The 1-d float32 tensors that hold rotary frequency factors (llama.cpp's LLM_TENSOR_ROPE_FREQS
# and LLM_TENSOR_ROPE_FACTORS_LONG / _SHORT), by architecture: read into the config's
# ``rope_scaling`` (:func:`rope_factor_scaling`), not into the weights.
ROPE_FACTOR_TENSORS = {
    "llama": ("rope_freqs.weight",),
    "smollm3": ("rope_freqs.weight",),
    "phi3": ("rope_factors_long.weight", "rope_factors_short.weight"),
}


def factor_tensor(reader: Any, name: str, count: int) -> list[float] | None:
    """The ``count`` values of the 1-d F32 tensor ``name``, or ``None`` if the file has no
    such tensor. Any other type or length is an error naming the tensor (llama.cpp's rope
    takes its frequency factors as float32 only)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    from gguf import GGMLQuantizationType

    dims = [int(d) for d in tensor.shape.tolist()]
    if int(tensor.tensor_type) != 0 or dims != [count]:
        try:
            type_name = GGMLQuantizationType(int(tensor.tensor_type)).name
        except ValueError:
            type_name = f"ggml type {int(tensor.tensor_type)}"
        raise ModelLoadError(
            f"GGUF tensor {name!r} holds rotary frequency factors: it must be F32 of shape "
            f"[{count}] (half the rotary dimensions), not {type_name} of shape {dims[::-1]}; "
            "re-export the model with llama.cpp")
    if tensor.data is None or np.asarray(tensor.data).nbytes != 4 * count:
        raise ModelLoadError(f"GGUF tensor {name!r} (F32, shape [{count}]) is cut short: the "
                             "file is truncated or corrupt - re-download it")
    values = np.asarray(tensor.data).view(np.float32).reshape(-1)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ModelLoadError(f"GGUF tensor {name!r} holds rotary frequency factors, which must "
                             "be finite and positive; re-export the model")
    return [float(v) for v in values]


def rope_factor_scaling(reader: Any, arch: str, rotary_dim: int,
                        scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """``rope_scaling`` with the file's rotary frequency factors, as llama.cpp applies them
    (``ggml_rope_ext``'s ``freq_factors``: pair ``i`` turns at ``base^(-2i/d) / factor[i]``).

    * llama's (and smollm3's) ``rope_freqs.weight`` (llama 3.1 and later: the converter's
      llama3 scaling, computed once): type ``factors`` with those ``factors`` (and a linear
      ``factor`` where the metadata also has one);
    * phi3's ``rope_factors_long`` / ``_short`` (LongRoPE: Phi-3 128k, Phi-3.5, Phi-4-mini):
      transformers' ``longrope`` with ``long_factor`` / ``short_factor``, the
      ``rope.scaling.attn_factor`` (llama.cpp's default 1 where it is missing) and
      ``rope.scaling.original_context_length`` (llama.cpp's ``n_ctx_orig_yarn``: the long
      factors apply where the context limit exceeds it).
    ``scaling`` (the metadata's, :func:`rope_scaling`) is returned where there are none."""
    names = ROPE_FACTOR_TENSORS.get(arch, ())
    values = [factor_tensor(reader, name, rotary_dim // 2) for name in names]
    if all(v is None for v in values):
        return scaling
    if len(names) == 1:  # one set for every position
        out: dict[str, Any] = {"rope_type": "factors", "factors": values[0]}
        if scaling is not None:
            if scaling["rope_type"] != "linear":
                raise ModelLoadError(
                    f"GGUF with rope_freqs.weight and rope scaling {scaling['rope_type']!r}: "
                    "FreeToken combines the frequency factors with linear scaling only")
            out["factor"] = scaling["factor"]
        return out
    if any(v is None for v in values):
        missing = names[values.index(None)]
        raise ModelLoadError(f"GGUF has {names[1 - values.index(None)]!r} but not {missing!r}; "
                             "LongRoPE needs both - re-export the model with llama.cpp")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF with LongRoPE factors lacks "
                             f"'{arch}.rope.scaling.original_context_length'; re-export the "
                             "model with llama.cpp")
    return {"rope_type": "longrope", "long_factor": values[0], "short_factor": values[1],
            "attention_factor": float(field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
            "original_max_position_embeddings": int(original)}


def build_config(reader: Any) -> dict[str, Any]:
    """The ``config.json`` dict of the Hugging Face model the GGUF metadata describes."""
    arch = architecture(reader)
    p = f"{arch}."
    hidden = int(require(reader, p + "embedding_length"))
    heads = int(require(reader, p + "attention.head_count"))
    kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(field(reader, p + "attention.key_length", hidden // heads))
    rope_dim = int(field(reader, p + "rope.dimension_count", head_dim))
    # Partial rotary (Phi-4-mini: the first 3/4 of each head): llama.cpp's NEOX rotation of
    # the first rope_dim dimensions is transformers' partial_rotary_factor.
    if rope_dim != head_dim and not (arch == "phi3" and 0 < rope_dim < head_dim
                                     and rope_dim % 2 == 0):
        raise ModelLoadError(
            f"GGUF {p}rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary) "
            "is supported for phi3 only; use a GGUF whose rotary embedding covers the whole "
            "head")
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(require(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(require(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, p + "context_length", 2048)),
        "vocab_size": embedding_rows(reader) or token_count(reader),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    if arch == "phi3" and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "smollm3":  # llama.cpp: every 4th layer without RoPE (n_no_rope_layer_step)
        config["no_rope_layer_interval"] = 4
    if arch == "granite":
        config.update(_granite_config(reader, head_dim))
    config.update(special_token_ids(reader))
    scaling = rope_factor_scaling(reader, arch, rope_dim, rope_scaling(reader, arch))
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _gemma3_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys beyond the common ones, as llama.cpp reads them (src/llama-model.cpp):
    every 6th layer global, the others sliding; local rope base 10,000; the query scaled by
    1/sqrt(head_dim), except the 62-layer 27B (1/sqrt(hidden / heads))."""
    layers = config["num_hidden_layers"]
    window = field(reader, "gemma3.attention.sliding_window")
    scalar = config["head_dim"]
    if layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(field(reader, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, "gemma3.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window is not None else None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _granite_config(reader: Any, head_dim: int) -> dict[str, Any]:
    """Granite's multipliers as llama.cpp reads them (src/models/granite.cpp): a missing or
    zero key is none (the attention scale then Llama's ``head_dim ** -0.5``)."""
    if field(reader, "granite.rope.scaling.finetuned", True) is False:
        raise ModelLoadError("GGUF granite without rotary embedding "
                             "(granite.rope.scaling.finetuned false) is not supported")

    def scale(key: str, default: float) -> float:
        value = float(field(reader, f"granite.{key}", 0.0))
        return value if value != 0.0 else default

    return {"embedding_multiplier": scale("embedding_scale", 1.0),
            "residual_multiplier": scale("residual_scale", 1.0),
            "attention_multiplier": scale("attention.scale", head_dim ** -0.5),
            "logits_scaling": scale("logit_scale", 1.0)}


def embedding_rows(reader: Any) -> int:
    """Rows of ``token_embd.weight`` (= the model's vocab size), 0 if the tensor is missing.

    This equals the number of tokens for ordinary files; when a vocabulary is padded, the
    weights (not the token list) decide the size ``LlamaForCausalLM`` must be built with.
    """
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    return 0


def special_token_ids(reader: Any) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` present in the GGUF metadata."""
    ids: dict[str, int] = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = field(reader, gguf_key)
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` dict: the special token ids of ``config``."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


# --------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------

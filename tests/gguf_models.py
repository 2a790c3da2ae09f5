"""Random-weight GGUF files of any supported architecture and block types, for tests and
benches: tensors named and keyed the way llama.cpp's ``convert_hf_to_gguf.py`` writes them,
the tokenizer (vocabulary, merges, chat template) copied from the default model's file.

Quantized weights are random blocks with finite scales chosen so that the weights are of
the size of a trained model's (|w| ~ 0.02-0.05); the oracle is transformers' GGUF loader,
which dequantizes the same blocks, so no quantizer is needed for any type."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf_writing import finish

# ggml type id -> (weights per block, bytes per block, [(fp16 scale field offsets)], the
# largest |quant value x sub-scale| a weight gets: d is chosen from it)
_LAYOUT: dict[int, tuple[int, int, tuple[int, ...], float]] = {
    2: (32, 18, (0,), 8),             # Q4_0: d (q - 8)
    3: (32, 20, (0, 2), 15),          # Q4_1: d q + m
    6: (32, 22, (0,), 16),            # Q5_0
    7: (32, 24, (0, 2), 31),          # Q5_1
    8: (32, 34, (0,), 127),           # Q8_0
    10: (256, 84, (80, 82), 45),      # Q2_K: d sc q - dmin m (4-bit sc, 2-bit q)
    11: (256, 110, (108,), 128),      # Q3_K: d (s - 32) q
    12: (256, 144, (0, 2), 945),      # Q4_K: 6-bit sc, 4-bit q
    13: (256, 176, (0, 2), 1953),     # Q5_K
    14: (256, 210, (208,), 4096),     # Q6_K: int8 sc, q - 32
    20: (32, 18, (0,), 127),          # IQ4_NL
    23: (256, 136, (0,), 4064),       # IQ4_XS: (ls - 32) table
    16: (256, 66, (0,), 167),         # IQ2_XXS: (0.5 + ls) / 4 x grid level (<= 43)
    17: (256, 74, (0,), 167),         # IQ2_XS
    22: (256, 82, (0,), 167),         # IQ2_S
    18: (256, 98, (0,), 481),         # IQ3_XXS: (0.5 + ls) / 2 x level (<= 62)
    21: (256, 110, (0,), 465),        # IQ3_S: (1 + 2 ls) x level (<= 15)
    19: (256, 50, (0,), 17),          # IQ1_S: (2 ls + 1) x (level +- 1/8)
    29: (256, 56, (48,), 17),         # IQ1_M: d in the top nibbles of 4 u16 at 48 (_set_d)
}
# MXFP4 (39): 32 weights in 17 bytes, 2^(e - 128) x level for its E8M0 byte e at 0 (no
# float16 scale: random_blocks sets e itself).
_MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

# The min (Q4_1 / Q5_1 m, K-quants' dmin) over d that puts the mean weight near zero: the
# mean quant (x the mean sub-scale over the mean sub-min, for the K-quants), negated where
# the min is added rather than subtracted.
_MIN_RATIO = {3: -7.5, 7: -15.5, 10: 1.5, 12: 7.5, 13: 15.5}

_GAINS = {"attn_q.weight": 2.0, "attn_k.weight": 2.0, "attn_qkv.weight": 2.0,
          "attn_output.weight": 3.0, "ffn_down.weight": 3.0, "token_embd.weight": 3.0,
          "output.weight": 3.0}

F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 30, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 12, 13, 14, 20, 23, 39
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = 16, 17, 22, 18, 21, 19, 29


def _set_d(blocks: np.ndarray, qtype: int, offset: int, values: np.ndarray) -> None:
    """Each block's float16 scale at ``offset`` set to ``values`` (IQ1_M: d's nibbles in
    the top 4 bits of its four u16 scales at 48, its 3-bit sub-block scales kept)."""
    halves = values.astype(np.float16)
    if qtype != IQ1_M:
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
        return
    scales = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF
    for k in range(4):
        scales[:, k] |= ((halves.view(np.uint16) >> (4 * k)) & 15) << 12
    blocks[:, 48:56] = scales.view(np.uint8)


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int,
                  scale: float = 0.03) -> np.ndarray:
    """uint8 ``[rows, cols / block * bytes]``: random blocks of ``qtype`` whose weights
    reach about ``scale``; F32 / F16 / BF16 as their raw bytes."""
    if qtype in (F32, F16, BF16):
        values = rng.normal(0.0, scale / 2, size=(rows, cols)).astype(np.float32)
        if qtype == F32:
            return values.view(np.uint8).reshape(rows, -1)
        if qtype == F16:
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    if qtype == MXFP4:
        # d the power of two nearest the one that spreads the levels (uniform nibbles) to
        # scale / 2, or half of it
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 17), dtype=np.uint8)
        spread = float(np.std(_MXFP4_LEVELS))
        e = 128 + round(np.log2((scale / 2) / spread)) - rng.integers(0, 2, blocks.shape[0])
        blocks[:, 0] = e
        return blocks.reshape(rows, -1)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    block, size, fields, reach = _LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = (scale / reach) * rng.uniform(0.5, 1.0, size=blocks.shape[0])
    # Scaled so that the weights' standard deviation is scale / 2, as the float types'
    # (a sub-scale times a quant spreads less than either alone).
    sample = blocks[:64].copy()
    _set_d(sample, qtype, fields[0], d[:64])
    if len(fields) == 2:
        minimum = (d[:64] * _MIN_RATIO[qtype]).astype(np.float16)
        sample[:, fields[1]:fields[1] + 2] = minimum.view(np.uint8).reshape(-1, 2)
    spread = float(np.std(dequantize(sample.reshape(-1), GGMLQuantizationType(qtype))))
    d *= (scale / 2) / max(spread, 1e-12)
    values = [d]
    if len(fields) == 2:  # a min: centre the weights (on average) around zero
        values.append(d * _MIN_RATIO[qtype])
    for offset, value in zip(fields, values):
        _set_d(blocks, qtype, offset, value)
    return blocks.reshape(rows, -1)


def mxfp4_exponents(rows: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """MXFP4 rows (uint8 ``[rows, blocks * 17]``) with their blocks' E8M0 bytes set to
    ``exponents`` in turn (repeated to the block count): blocks at scales 2^(e - 128) the
    caller picks, e.g. a wide range, or the subnormal and overflowing ones."""
    blocks = rows.copy().reshape(-1, 17)
    blocks[:, 0] = np.resize(np.asarray(exponents, dtype=np.uint8), blocks.shape[0])
    return blocks.reshape(rows.shape)


def _tokenizer_fields(source: Path) -> list[tuple[str, Any, Any]]:
    """``(key, value, GGUFValueType)`` of every ``tokenizer.*`` field of ``source`` (read
    once a file version: gguf-py takes 2-4 s over the default model's 49,152 tokens; the
    values are shared, not to be changed)."""
    stat = Path(source).stat()
    return list(_read_tokenizer_fields(Path(source), stat.st_mtime_ns, stat.st_size))


@functools.cache
def _read_tokenizer_fields(source: Path, mtime_ns: int, size: int
                           ) -> tuple[tuple[str, Any, Any], ...]:
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for key, f in GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            item = f.types[1]
            if item == GGUFValueType.STRING:
                value = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                value = [f.parts[i].tolist()[0] for i in f.data]
            fields.append((key, value, (GGUFValueType.ARRAY, item)))
        elif f.types[0] == GGUFValueType.STRING:
            fields.append((key, bytes(f.parts[f.data[0]]).decode("utf-8"), (f.types[0],)))
        else:
            fields.append((key, f.parts[f.data[0]].tolist()[0], (f.types[0],)))
    return tuple(fields)


_FIM_ID_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
                "tokenizer.ggml.fim_mid_token_id")


def _with_extra_tokens(fields: list[tuple[str, Any, Any]], extra: Sequence[tuple[str, int]],
                       fim_ids: bool, vocab: int) -> list[tuple[str, Any, Any]]:
    """``fields`` with ``extra`` appended to the token, token type and score arrays (and,
    with ``fim_ids``, the FIM id keys of the first three)."""
    from gguf import GGUFValueType

    appended = {"tokenizer.ggml.tokens": [text for text, _ in extra],
                "tokenizer.ggml.token_type": [kind for _, kind in extra],
                "tokenizer.ggml.scores": [-1000.0] * len(extra)}
    out = [(key, value + appended[key] if key in appended else value, kind)
           for key, value, kind in fields]
    if fim_ids:
        if len(extra) < 3:
            raise ValueError("fim_ids needs the prefix, suffix and middle tokens first")
        out += [(key, vocab + i, (GGUFValueType.UINT32,)) for i, key in enumerate(_FIM_ID_KEYS)]
    return out


# The architectures whose blocks norm after attention and MLP, not before (OLMo 2, EXAONE 4).
_POST_NORMED = ("olmo2", "exaone4")
# Cohere's: parallel blocks (one LayerNorm a block, of eps attention.layer_norm_epsilon).
_PARALLEL = ("command-r", "cohere2")
# The architectures whose MLP is not gated: act(ffn_up) (Arcee's ReLU², StarCoder2's GELU).
_UNGATED = ("arcee", "starcoder2")


def write_gguf(path: Path, arch: str, *, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, head_dim: int | None = None, ff: int = 128,
               weight_type: int = Q8_0, types: dict[str, int] | None = None,
               tied: bool = True, seed: int = 0, context: int = 2048,
               rope_theta: float = 10000.0, sliding_window: int = 8,
               tokenizer_from: Path | None = None, extra_rows: int = 0,
               extra_tokens: Sequence[tuple[str, int]] = (), fim_ids: bool = False,
               rope_dims: int | None = None,
               rope_factors: dict[str, Sequence[float]] | None = None,
               metadata: dict[str, int | float | str] | None = None,
               split_max_tensors: int = 0, experts: int = 0, experts_used: int = 2,
               expert_ff: int | None = None, shared_ff: int = 0,
               file_arch: str | None = None, biases: bool = False, qk_norm: bool = False
               ) -> Path:
    """A random ``arch`` model (llama, qwen2, qwen3, qwen3moe, qwen2moe, gpt-oss, gemma2,
    gemma3, glm4, olmo2, olmoe and granitemoe (with ``experts``), exaone4, ernie4_5, seed_oss, arcee,
    starcoder2 (with ``biases``), hunyuan-dense, command-r, cohere2 or phi3) as a
    GGUF file (gpt-oss: biases, sinks and expert biases as its files have them, its rope
    scaling from ``metadata``; seed_oss: q/k/v biases; gemma2: its softcaps from ``metadata``,
    else 50 and 30, as the converter writes transformers' defaults).

    ``weight_type`` is every 2-d weight's type; ``types`` overrides it by the end of the
    tensor name (e.g. ``{"attn_v.weight": Q6_K, "token_embd.weight": Q6_K}``). The
    vocabulary is ``tokenizer_from``'s (default: the default model's file); ``extra_rows``
    more embedding rows than it has tokens (a padded vocabulary).

    ``extra_tokens``: ``(text, token type)`` pairs appended to that vocabulary (token type
    as llama.cpp numbers them: 3 control, 4 user-defined, ...; where the file has scores,
    -1000, as llama.cpp's converter scores added tokens); the embedding (and output) rows
    grow with it. ``fim_ids``: the first three of
    them are the FIM prefix, suffix and middle tokens, written as
    ``tokenizer.ggml.fim_{pre,suf,mid}_token_id``.

    ``rope_dims``: ``rope.dimension_count`` (default the head size; fewer for phi3's partial
    rotary). ``rope_factors``: F32 frequency-factor tensors by name (``rope_freqs.weight``,
    ``rope_factors_long.weight`` ...), written before the weights as the converter writes
    the tensors it generates. ``metadata``: more keys (under ``{arch}.`` unless they start
    with it or ``tokenizer.``), an int as uint32, a float as float32, a str as a string, a
    list as an array.
    ``split_max_tensors``: a split GGUF of shards of at most that many tensors, as
    llama.cpp's ``gguf-split`` writes them (``{stem}-00001-of-0000N.gguf`` ..., the metadata
    in the first); the first shard's path is returned.

    ``biases``: every linear's bias but the head's (ernie4_5: as the converter writes a
    ``use_bias`` model's).

    ``file_arch``: the ``general.architecture`` written and its keys' prefix, where the file
    names another architecture of ``arch``'s tensors (e.g. ``qwen3vl``: Qwen3-VL's language
    model, ``qwen3``'s tensors).

    ``experts``: mixture-of-experts MLPs of that many experts (a ``llama`` file with them is
    Mixtral's; ``qwen3moe`` needs them), ``experts_used`` per token, each of ``expert_ff``
    features (qwen3moe's ``expert_feed_forward_length``, default ``ff``; llama's experts
    are ``ff`` wide): the F32 router ``ffn_gate_inp`` and the 3-d ``ffn_{gate,up,down}_exps``
    tensors in place of the dense MLP's; ``shared_ff``: qwen2moe's shared expert
    (``ffn_{gate,up,down}_shexp``, its 1-d F32 gate ``ffn_gate_inp_shexp``) of that width.

    command-r and cohere2 as llama.cpp's converter writes Cohere's checkpoints: one norm a
    block, ``attention.layer_norm_epsilon`` (1e-5) in place of the RMS eps, ``logit_scale`` (from
    ``metadata``, else transformers' default 0.0625), no rope scaling (cohere2: its
    ``vocab_size`` and ``attention.sliding_window``); ``qk_norm``: command-r's per-head q/k
    norms (Command R+: F32 ``[heads, head_dim]``)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from freetoken_core.models.resolve import default_gguf_path

    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    tokenizer_fields = _tokenizer_fields(tokenizer_from or default_gguf_path())
    vocab = next(len(v) for k, v, _ in tokenizer_fields if k == "tokenizer.ggml.tokens")
    if extra_tokens:
        tokenizer_fields = _with_extra_tokens(tokenizer_fields, extra_tokens, fim_ids, vocab)
        vocab += len(extra_tokens)
    elif fim_ids:
        raise ValueError("fim_ids names the first three extra_tokens; there are none")
    writer = GGUFWriter(str(path), file_arch or arch, split_max_tensors=split_max_tensors)
    p = f"{file_arch or arch}."
    writer.add_uint32(p + "context_length", context)
    writer.add_uint32(p + "embedding_length", hidden)
    writer.add_uint32(p + "block_count", layers)
    writer.add_uint32(p + "feed_forward_length", ff)
    writer.add_uint32(p + "attention.head_count", heads)
    writer.add_uint32(p + "attention.head_count_kv", kv_heads)
    writer.add_uint32(p + "attention.key_length", head_dim)
    writer.add_uint32(p + "attention.value_length", head_dim)
    writer.add_uint32(p + "rope.dimension_count", rope_dims or head_dim)
    writer.add_float32(p + "rope.freq_base", rope_theta)
    if arch in (*_PARALLEL, "starcoder2"):  # (LayerNorms)
        writer.add_float32(p + "attention.layer_norm_epsilon", 1e-5)
    else:
        writer.add_float32(p + "attention.layer_norm_rms_epsilon", 1e-6)
    if arch in _PARALLEL:
        writer.add_string(p + "rope.scaling.type", "none")
        if "logit_scale" not in (metadata or {}):
            writer.add_float32(p + "logit_scale", 0.0625)
    if arch == "cohere2":
        writer.add_uint32(p + "vocab_size", vocab + extra_rows)
    if arch in ("gemma2", "gemma3", "gpt-oss", "cohere2"):
        writer.add_uint32(p + "attention.sliding_window", sliding_window)
    if arch == "gemma2":
        for key, cap in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            if key not in (metadata or {}):
                writer.add_float32(p + key, cap)
    expert_ff = expert_ff or ff
    if experts:
        writer.add_uint32(p + "expert_count", experts)
        writer.add_uint32(p + "expert_used_count", experts_used)
        if arch not in ("llama", "olmoe", "granitemoe"):  # (theirs: feed_forward_length)
            writer.add_uint32(p + "expert_feed_forward_length", expert_ff)
        if shared_ff:
            writer.add_uint32(p + "expert_shared_feed_forward_length", shared_ff)
    for key, value in (metadata or {}).items():
        key = key if key.startswith((p, "tokenizer.")) else p + key
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for key, value, kind in tokenizer_fields:
        writer.add_key_value(key, value, kind[0], sub_type=kind[1] if len(kind) > 1 else None)

    def typed(name: str) -> int:
        for tail, qtype in (types or {}).items():
            if name.endswith(tail):
                return qtype
        return weight_type

    def matrix(name: str, rows: int, cols: int) -> None:
        # O(1)-scale activations, as tests/tiny_models.py's gains make them: logits well
        # apart, so greedy decoding is not decided by rounding noise.
        gain = next((g for tail, g in _GAINS.items() if name.endswith(tail)), 1.0)
        if arch in ("gemma2", "gemma3") and name == "token_embd.weight":
            gain /= hidden ** 0.5  # Gemma scales the embeddings by sqrt(hidden)
        qtype = typed(name)
        raw = random_blocks(rng, qtype, rows, cols, scale=1.7 * gain / cols ** 0.5)
        writer.add_tensor(name, raw, raw_shape=raw.shape,
                          raw_dtype=GGMLQuantizationType(qtype))

    def stacked(name: str, count: int, rows: int, cols: int) -> None:
        # [count, rows, cols] (ggml: [cols, rows, count]): one matrix per expert
        gain = next((g for tail, g in _GAINS.items() if name.endswith(tail)), 1.0)
        raw = random_blocks(rng, typed(name), count * rows, cols,
                            scale=1.7 * gain / cols ** 0.5).reshape(count, rows, -1)
        writer.add_tensor(name, raw, raw_shape=raw.shape,
                          raw_dtype=GGMLQuantizationType(typed(name)))

    def vector(name: str, n: int, around: float = 1.0) -> None:
        writer.add_tensor(name, (around + rng.normal(0, 0.1, n)).astype(np.float32))

    norm_one = 1.0  # (Gemma's converter stores 1 + w: there, w ~ 0)
    for name, values in (rope_factors or {}).items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    matrix("token_embd.weight", vocab + extra_rows, hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        b = f"blk.{i}."
        if arch not in _POST_NORMED:  # (norms after attention and MLP only)
            vector(b + "attn_norm.weight", hidden, norm_one)
        if arch == "phi3":
            matrix(b + "attn_qkv.weight", q + 2 * kv, hidden)
            matrix(b + "ffn_up.weight", 2 * ff, hidden)
        elif arch == "glm4":  # (q/k/v apart, gate and up in one tensor: gate rows first)
            matrix(b + "attn_q.weight", q, hidden)
            matrix(b + "attn_k.weight", kv, hidden)
            matrix(b + "attn_v.weight", kv, hidden)
            matrix(b + "ffn_up.weight", 2 * ff, hidden)
        else:
            matrix(b + "attn_q.weight", q, hidden)
            matrix(b + "attn_k.weight", kv, hidden)
            matrix(b + "attn_v.weight", kv, hidden)
            if experts:
                # (llama-quantize keeps the router F32; logits of a few units)
                writer.add_tensor(b + "ffn_gate_inp.weight", rng.normal(
                    0.0, 1.5 / hidden ** 0.5, (experts, hidden)).astype(np.float32))
                stacked(b + "ffn_gate_exps.weight", experts, expert_ff, hidden)
                stacked(b + "ffn_up_exps.weight", experts, expert_ff, hidden)
                if arch == "gpt-oss":  # (F32 biases, [experts, features] as in its files)
                    vector(b + "ffn_gate_inp.bias", experts, 0.0)
                    for name, n in (("gate", expert_ff), ("up", expert_ff), ("down", hidden)):
                        writer.add_tensor(f"{b}ffn_{name}_exps.bias", rng.normal(
                            0.0, 0.1, (experts, n)).astype(np.float32))
                if shared_ff:
                    vector(b + "ffn_gate_inp_shexp.weight", hidden, 0.0)
                    matrix(b + "ffn_gate_shexp.weight", shared_ff, hidden)
                    matrix(b + "ffn_up_shexp.weight", shared_ff, hidden)
                    matrix(b + "ffn_down_shexp.weight", hidden, shared_ff)
            else:
                if arch not in _UNGATED:  # (act(ffn_up) alone)
                    matrix(b + "ffn_gate.weight", ff, hidden)
                matrix(b + "ffn_up.weight", ff, hidden)
        if arch in ("qwen2", "qwen2moe", "gpt-oss", "glm4", "seed_oss") or biases:
            for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
                vector(b + name, n, 0.0)
        if biases:
            for name, n in (("attn_output.bias", hidden), ("ffn_gate.bias", ff),
                            ("ffn_up.bias", ff), ("ffn_down.bias", hidden)):
                if not (name == "ffn_gate.bias" and arch in _UNGATED):
                    vector(b + name, n, 0.0)
        if arch == "starcoder2":  # (its LayerNorms' biases)
            vector(b + "attn_norm.bias", hidden, 0.0)
            vector(b + "ffn_norm.bias", hidden, 0.0)
        if arch == "gpt-oss":
            vector(b + "attn_output.bias", hidden, 0.0)
            writer.add_tensor(b + "attn_sinks.weight", rng.normal(0.0, 1.0, heads).astype(
                np.float32))
        if arch in ("qwen3", "qwen3moe", "gemma3", "exaone4", "hunyuan-dense"):
            vector(b + "attn_q_norm.weight", head_dim, norm_one)
            vector(b + "attn_k_norm.weight", head_dim, norm_one)
        if qk_norm:  # (Command R+: a weight per head, F32 as the converter keeps norms)
            writer.add_tensor(b + "attn_q_norm.weight", (norm_one + rng.normal(
                0, 0.1, (heads, head_dim))).astype(np.float32))
            writer.add_tensor(b + "attn_k_norm.weight", (norm_one + rng.normal(
                0, 0.1, (kv_heads, head_dim))).astype(np.float32))
        if arch in ("olmo2", "olmoe"):  # (over all heads at once)
            vector(b + "attn_q_norm.weight", q, norm_one)
            vector(b + "attn_k_norm.weight", kv, norm_one)
        matrix(b + "attn_output.weight", hidden, q)
        if experts:
            stacked(b + "ffn_down_exps.weight", experts, hidden, expert_ff)
        else:
            matrix(b + "ffn_down.weight", hidden, ff)
        if arch not in (*_POST_NORMED, *_PARALLEL):
            vector(b + ("post_attention_norm.weight" if arch in ("gpt-oss", "seed_oss")
                        else "ffn_norm.weight"), hidden, norm_one)
        if arch in ("gemma2", "gemma3", "glm4", *_POST_NORMED):
            vector(b + "post_attention_norm.weight", hidden, norm_one)
            vector(b + "post_ffw_norm.weight", hidden, norm_one)
    vector("output_norm.weight", hidden, norm_one)
    if arch == "starcoder2":
        vector("output_norm.bias", hidden, 0.0)
    if not tied:
        matrix("output.weight", vocab + extra_rows, hidden)
    finish(writer)
    shards = writer.format_shard_names(path)
    return shards[0]

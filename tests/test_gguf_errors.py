"""A GGUF file FreeToken cannot serve gets one clear error naming the tensor, before the
model is allocated: a block type FreeToken does not compute with, a file cut short, a row
width that is not a whole number of its type's blocks; and a model without a chat template
says how to give it one."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf_models import Q8_0, write_gguf

from freetoken_core import LLM
from freetoken_core.errors import InvalidRequest, ModelLoadError
from freetoken_core.tokenizer import apply_chat_template


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Where the tensor info of ``name`` (after its name: n_dims, dims, type, offset) starts."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def _set_type(path: Path, name: str, qtype: int) -> None:
    data = bytearray(path.read_bytes())
    at = _tensor_info_offset(bytes(data), name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, qtype)
    path.write_bytes(bytes(data))


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", "llama", weight_type=Q8_0)


def test_an_unsupported_block_type_is_named_with_its_tensor(tiny: Path) -> None:
    # TQ1_0 (34): 54-byte blocks of 256 weights; blk.0.ffn_down's 128-wide rows are not
    # whole blocks of it either, but the type is what the message must name first.
    _set_type(tiny, "blk.0.ffn_down.weight", 34)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' is TQ1_0.*supported"):
        LLM(str(tiny), progress=False, plugins="none")


def test_an_unknown_type_id_is_named_with_its_tensor(tiny: Path) -> None:
    _set_type(tiny, "blk.1.attn_q.weight", 77)
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_q\.weight' is of ggml type id 77"):
        LLM(str(tiny), progress=False, plugins="none")


def test_a_truncated_file_names_the_first_tensor_it_lacks(tiny: Path) -> None:
    data = tiny.read_bytes()
    tiny.write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match=r"GGUF tensor '[^']+' .* needs \d+ bytes but the "
                                             r"file holds \d+ of them: .* truncated"):
        LLM(str(tiny), progress=False, plugins="none")


def test_a_row_width_that_is_not_whole_blocks_is_named(tiny: Path) -> None:
    # Q4_K (12) blocks hold 256 weights; the file's rows are 64 wide (its bytes are Q8_0's,
    # so the size check would fail too: the width is checked first).
    _set_type(tiny, "blk.0.attn_k.weight", 12)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_k\.weight' \(Q4_K\) has rows of 64 "
                                             r"values, not a whole number of 256-value blocks"):
        LLM(str(tiny), progress=False, plugins="none")


def test_a_model_without_a_chat_template_says_to_give_one(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "no-template.gguf", "llama", weight_type=Q8_0)
    reader = GGUFReader(path)
    assert "tokenizer.chat_template" in reader.fields
    # The same model with its template's key renamed (the bytes stay, the key is not found).
    data = bytearray(path.read_bytes())
    key = b"tokenizer.chat_template"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8
    data[at:at + len(key)] = b"tokenizer.chat_templatX"
    path.write_bytes(bytes(data))
    llm = LLM(str(path), progress=False, plugins="none", kv_cache_tokens=512)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequest) as info:
        apply_chat_template(llm.tokenizer, messages)
    assert info.value.param == "messages"
    assert "no chat template; start the server with --chat-template FILE" in info.value.message
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    for given in (str(template), template.read_text()):
        with_template = LLM(str(path), progress=False, plugins="none", kv_cache_tokens=512,
                            chat_template=given)
        assert apply_chat_template(with_template.tokenizer, messages) == "<user>Hi<assistant>"
    with pytest.raises(InvalidRequest) as info:
        LLM(str(path), progress=False, plugins="none", chat_template=str(tmp_path / "nope"))
    assert info.value.param == "chat_template"

"""Tests of the offline tiny-model helpers in :mod:`tiny_models`."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import (
    ARCHS,
    BOS_TOKEN,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    FIM_TOKENS,
    IM_START_TOKEN,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    build_tokenizer,
    make_tiny_model,
)
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH_NAMES = sorted(ARCHS)

UNICODE_SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "café naïve Zürich São Paulo",
    "Ελληνικά русский 日本語 中文 한국어",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "combining: e\u0301 a\u0308, zero-width:\u200b\u200d, nbsp:\u00a0",
    "control \x00\x01\x7f and surrogate-free astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "<think>reasoning</think> answer <|im_end|> <fim_prefix>",
    "",
]

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


# ---------------------------------------------------------------------------------------------
# Fixtures (module-scoped: every artefact is built once)
# ---------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the saved tokenizer."""
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer as reloaded from disk by ``AutoTokenizer``."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module", params=ARCH_NAMES)
def arch(request: pytest.FixtureRequest) -> str:
    """Each architecture supported by :func:`make_tiny_model`."""
    return request.param


@pytest.fixture(scope="module")
def model_dir(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model directory per architecture (default seed and config)."""
    return make_tiny_model(tmp_path_factory.mktemp(f"model-{arch}"), arch)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model and tokenizer of ``model_dir`` loaded with the HF auto classes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _greedy(
    model: Any, tok: PreTrainedTokenizerBase, prompt: str, n: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy-generate ``n`` tokens; return the new ids and the raw logits ``[steps, vocab]``."""
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits, dim=0)


def _longest_run(ids: list[int]) -> int:
    best = run = 1 if ids else 0
    for prev, cur in itertools.pairwise(ids):
        run = run + 1 if prev == cur else 1
        best = max(best, run)
    return best


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_files(tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tokenizer_dir / name).is_file()
    config = _read_json(tokenizer_dir / "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHATML_TEMPLATE
    assert config["bos_token"] == BOS_TOKEN
    assert config["eos_token"] == EOS_TOKEN


def test_special_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *THINK_TOKENS)}
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(set(ids.values())) == len(ids)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids.values()
    assert (ids[THINK_TOKENS[0]], ids[THINK_TOKENS[1]]) == (len(tokenizer) - 2, len(tokenizer) - 1)
    assert tokenizer.bos_token_id == ids[BOS_TOKEN] == 0
    assert tokenizer.eos_token_id == ids[EOS_TOKEN] == 2
    assert tokenizer.pad_token_id == ids[EOS_TOKEN]
    assert 512 <= len(tokenizer) <= 1000
    # FIM / ChatML are special (dropped by skip_special_tokens); <think> tags are not.
    assert set(FIM_TOKENS) | {IM_START_TOKEN} <= set(tokenizer.all_special_tokens)
    assert not set(THINK_TOKENS) & set(tokenizer.all_special_tokens)


def test_all_bytes_in_vocab(tokenizer: PreTrainedTokenizerBase) -> None:
    vocab = tokenizer.get_vocab()
    assert all(ch in vocab for ch in pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_unicode_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids) == text
    # Per-token bytes (what a streaming detokenizer works with) concatenate back too.
    assert b"".join(_token_bytes(tokenizer, t) for t in ids).decode("utf-8") == text


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: vocab character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    mapping = {b: b for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in printable):
        mapping[b] = 256 + extra
    return {chr(cp): b for b, cp in mapping.items()}


def _token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The raw bytes of one token (byte-level BPE: each vocab char stands for one byte)."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token in tokenizer.get_added_vocab():
        return token.encode("utf-8")
    return bytes(_byte_decoder()[ch] for ch in token)


def test_byte_decoder_matches_alphabet() -> None:
    assert set(_byte_decoder()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_byte_decoder().values()) == list(range(256))


def test_special_and_think_tokens_are_atomic(tokenizer: PreTrainedTokenizerBase) -> None:
    think, end_think = (tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS)
    fim = [tokenizer.convert_tokens_to_ids(t) for t in FIM_TOKENS]
    ids = tokenizer.encode("<fim_prefix>a<fim_suffix>b<fim_middle><think>x</think>y")
    assert ids.count(think) == ids.count(end_think) == 1
    assert {fim[0], fim[1], fim[2]} <= set(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "ab<think>x</think>y"


def test_no_bos_added(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.bos_token_id not in tokenizer.encode("hello")


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected + "<|im_start|>assistant\n"
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START_TOKEN)
    assert ids.count(tokenizer.eos_token_id) == 4
    assert tokenizer.decode(ids) == rendered


def test_build_tokenizer_is_deterministic(
    tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = tmp_path_factory.mktemp("tokenizer-again")
    returned = build_tokenizer(other)
    saved = (tokenizer_dir / "tokenizer.json").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == saved
    assert len(returned) == len(AutoTokenizer.from_pretrained(tokenizer_dir))


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def test_model_dir_contents(model_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / name).is_file(), name
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    assert config["bos_token_id"] == generation["bos_token_id"] == 0
    assert config["eos_token_id"] == generation["eos_token_id"] == 2
    assert config["pad_token_id"] == generation["pad_token_id"] == 2
    assert config["rope_theta"] == 10000.0
    assert config["torch_dtype"] == "float32"
    assert config["hidden_size"] == 64
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16


def test_model_loads_with_expected_shapes(
    arch: str, model_dir: Path, loaded: tuple[Any, PreTrainedTokenizerBase]
) -> None:
    model, tok = loaded
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert model.get_input_embeddings().weight.shape == (len(tok), 64)
    assert model.get_output_embeddings().weight.shape == (len(tok), 64)
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id

    config = _read_json(model_dir / "config.json")
    tensors = load_file(model_dir / "model.safetensors")
    names = set(tensors)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert ("lm_head.weight" in names) == (arch != "smollm2")
    assert config["tie_word_embeddings"] == (arch == "smollm2")
    assert any(n.endswith("q_proj.bias") for n in names) == (arch == "qwen2")
    assert any(n.endswith("q_norm.weight") for n in names) == (arch == "qwen3")
    rope_type = model.config.rope_parameters["rope_type"]
    if arch == "llama3":
        assert rope_type == "llama3"
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["original_max_position_embeddings"] == 64
    else:
        assert rope_type == "default"
        assert config["rope_scaling"] is None

    # The weights were re-initialised at O(1) scale, not HF's std 0.02.
    embed = tensors["model.embed_tokens.weight"]
    assert embed.std() > 0.3


def test_greedy_generate_16(loaded: tuple[Any, PreTrainedTokenizerBase]) -> None:
    model, tok = loaded
    new, logits = _greedy(model, tok, "Hello, world!", 16)
    assert len(new) == 16
    assert new == logits.argmax(-1).tolist()
    assert new == _greedy(model, tok, "Hello, world!", 16)[0]
    assert isinstance(tok.decode(new), str)


def test_greedy_generation_is_not_degenerate(loaded: tuple[Any, PreTrainedTokenizerBase]) -> None:
    model, tok = loaded
    gaps: list[torch.Tensor] = []
    for prompt in PROMPTS:
        new, logits = _greedy(model, tok, prompt, 64)
        assert len(new) == 64, f"stopped early on {prompt!r}: {new}"
        assert len(set(new)) >= 24, (prompt, new)
        assert _longest_run(new) <= 8, (prompt, new)
        assert not set(new) & set(range(len(SPECIAL_TOKENS)))
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    gap = torch.cat(gaps)
    assert gap.median() > 0.2
    assert (gap < 1e-3).float().mean() < 0.05


def test_seed_determinism(tmp_path: Path) -> None:
    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_config_overrides(tmp_path: Path) -> None:
    out = make_tiny_model(
        tmp_path, "qwen3", num_hidden_layers=3, max_position_embeddings=4096, rope_theta=5e5
    )
    config = _read_json(out / "config.json")
    assert config["num_hidden_layers"] == 3
    assert config["max_position_embeddings"] == 4096
    assert config["rope_theta"] == 5e5
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.model.layers) == 3


def test_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path, "gpt2")

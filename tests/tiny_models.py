"""Tiny, fully offline Hugging Face model directories for tests.

This is a helper module imported by tests (not a test file itself).  It builds

* a small byte-level BPE tokenizer, trained in-process on a built-in corpus, with ChatML,
  fill-in-the-middle and ``<think>`` tokens (:func:`build_tokenizer`), and
* complete model directories with random (but deliberately *well-conditioned*) weights for
  the Llama family of architectures (:func:`make_tiny_model`).

Nothing is downloaded; everything is deterministic for a given ``seed``.

The special tokens have fixed ids (see :data:`SPECIAL_TOKENS` / :data:`THINK_TOKENS`)::

    0 <|endoftext|>  (bos)        3 <fim_prefix>   5 <fim_suffix>
    1 <|im_start|>                4 <fim_middle>   6 <fim_pad>
    2 <|im_end|>     (eos, pad)
    640 <think>, 641 </think>     (non-special added tokens; len(tokenizer) == 642)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = [
    "ARCHS",
    "BOS_TOKEN",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "FIM_TOKENS",
    "IM_START_TOKEN",
    "SPECIAL_TOKENS",
    "THINK_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "build_tokenizer",
    "make_tiny_model",
]

BOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
FIM_TOKENS: tuple[str, ...] = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
#: Special tokens, in id order (ids 0..6).  ``skip_special_tokens=True`` drops these.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN, *FIM_TOKENS)
#: Reasoning delimiters.  Added as *non-special* tokens (as in Qwen3), so they are matched
#: atomically by the tokenizer but survive ``decode(..., skip_special_tokens=True)``.
THINK_TOKENS: tuple[str, str] = ("<think>", "</think>")

#: Size of the BPE vocabulary requested from the trainer (special + 256 bytes + merges).
TOKENIZER_VOCAB_SIZE = 640

#: ChatML, as in SmolLM2-Instruct, minus SmolLM2's injected default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. During inference the server keeps a cache of keys and values for every
layer, so that each new token only needs a single forward pass through the network. Sampling
turns the logits into probabilities: temperature rescales them, top-k keeps the k largest,
and top-p keeps the smallest set whose total probability is at least p. Greedy decoding simply
picks the token with the highest score at every step.

Once upon a time there was a little robot who wanted to learn how to write stories. Every
morning it read a book, and every evening it wrote a short paragraph about what it had learned.
The robot's friends were a cat, a bird and an old computer that could still count to ten.
"What is the meaning of a word?" asked the cat. "It is the company it keeps," said the computer.

User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower and the Louvre.
User: Can you write a function that adds two numbers?
Assistant: Sure! Here is a simple example in Python.

def add(a: int, b: int) -> int:
    """Return the sum of a and b."""
    return a + b


class Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.items: dict[str, list[float]] = {}

    def get(self, key: str) -> list[float] | None:
        return self.items.get(key)

    def put(self, key: str, value: list[float]) -> None:
        if len(self.items) >= self.size:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
data = {"name": "tiny", "layers": 2, "heads": [4, 2], "ok": true, "value": null}
print(json.dumps(data, indent=2))

function greet(name) {
  return `Hello, ${name}!`;
}
const numbers = [1, 2, 3, 4, 5].map((x) => x * x);
console.log(numbers.filter((n) => n > 4));

Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -1 +1 = < > <= >= != ==
Punctuation: ( ) [ ] { } , . ; : ! ? ' " ` ~ @ # $ % ^ & * _ - + / \\ |
Unicode: café, naïve, Zürich, São Paulo, Ελληνικά, русский, 日本語, 中文, 한국어, emoji 🙂🚀.
'''


def _train_backend_tokenizer() -> Tokenizer:
    """Train the byte-level BPE model on :data:`_CORPUS` and return the raw ``Tokenizer``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Repeat the corpus so that the pair counts (and thus merge order) are well separated.
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS],
    )
    return tok


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Build the tiny byte-level BPE tokenizer, save it to ``out_dir`` and return it.

    The tokenizer is trained in-process (no downloads) and is deterministic.  It has
    ``<|endoftext|>`` as bos, ``<|im_end|>`` as eos and pad, the FIM tokens as additional
    special tokens, ``<think>``/``</think>`` as non-special added tokens and a ChatML chat
    template.  Byte-level pre-tokenization/decoding makes ``decode(encode(s)) == s`` for any
    unicode string ``s``.  No bos is prepended on encode (like SmolLM2 / GPT-2).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_backend_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, *FIM_TOKENS],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    _patch_tokenizer_config(out_dir / "tokenizer_config.json")
    return tokenizer


def _patch_tokenizer_config(path: Path) -> None:
    """Make ``tokenizer_config.json`` look like a hub checkpoint's.

    transformers 5 writes ``"tokenizer_class": "TokenizersBackend"`` and keeps the chat
    template only in ``chat_template.jinja``; older transformers (and hand-written loaders)
    expect ``PreTrainedTokenizerFast`` and a ``chat_template`` key.  Both load identically
    with transformers 5.
    """
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["chat_template"] = CHATML_TEMPLATE
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

_LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

#: arch name -> (config class, model class, arch-specific config kwargs)
ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": _LLAMA3_ROPE_SCALING}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v projections have biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # per-head RMSNorm on q and k
    "smollm2": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
}

# Standard deviations of the re-initialised weights, as ``gain / sqrt(fan_in)`` for matrices.
# Tuned (see tests/test_tiny_models.py) so that greedy decoding of the random models is well
# separated (median top-1/top-2 logit gap ~0.6) and does not collapse into repeating a token:
# sharper attention (q/k gain 2, or q/k-norm weights ~2 for qwen3) and residual branches that
# dominate the input embedding (o/down gain 3) avoid the usual "copy the last token" attractor.
_EMBED_STD = 1.0
_MATRIX_GAINS: dict[str, float] = {
    "q_proj": 2.0,
    "k_proj": 2.0,
    "v_proj": 1.0,
    "o_proj": 3.0,
    "gate_proj": 1.0,
    "up_proj": 1.0,
    "down_proj": 3.0,
    "lm_head": 3.0,
}
_QK_NORM_SCALE = 2.0
_BIAS_STD = 0.1
# The output-head rows of the special tokens (bos/eos/ChatML/FIM) are scaled down so that the
# random models (like real base models) hardly ever pick them greedily: tests that generate N
# tokens then really get N tokens instead of stopping at a stray eos.  They still get a
# non-zero probability when sampling; use a logit bias to force eos in stop tests.
_SPECIAL_HEAD_SCALE = 0.5


def _reinit_weights(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Re-initialise ``model`` with O(1)-scale weights so that logits are well separated.

    HF's default init (std 0.02) makes all logits nearly equal, so greedy decoding of a
    random model would be decided by rounding noise.  Here: embeddings ~ N(0, 1) (or
    N(0, 3/sqrt(hidden)) when tied to the output head); matrices ~ N(0, gain / sqrt(fan_in))
    with the gains of :data:`_MATRIX_GAINS`; norm weights ~ U(0.9, 1.1) (times 2 for the
    per-head q/k norms); biases ~ N(0, 0.1).  The output-head rows of the special tokens
    (ids 0-6) are then halved so that greedy decoding rarely emits them.
    """
    tied = bool(model.config.tie_word_embeddings)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                fan_in = param.shape[1]
                std = _MATRIX_GAINS["lm_head"] / math.sqrt(fan_in) if tied else _EMBED_STD
                param.normal_(0.0, std, generator=generator)
            elif "norm" in name:
                param.uniform_(0.9, 1.1, generator=generator)
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.mul_(_QK_NORM_SCALE)
            elif name.endswith(".bias"):
                param.normal_(0.0, _BIAS_STD, generator=generator)
            else:
                kind = name.split(".")[-2]
                if kind not in _MATRIX_GAINS or param.dim() != 2:
                    raise AssertionError(f"unexpected parameter {name} {tuple(param.shape)}")
                gain = _MATRIX_GAINS[kind]
                param.normal_(0.0, gain / math.sqrt(param.shape[1]), generator=generator)
        head = model.get_output_embeddings().weight  # the embedding itself when tied
        head[: len(SPECIAL_TOKENS)] *= _SPECIAL_HEAD_SCALE


def _add_legacy_config_keys(config_path: Path) -> None:
    """Add hub-style ``rope_theta`` / ``rope_scaling`` / ``torch_dtype`` keys to config.json.

    transformers 5 writes only ``rope_parameters`` and ``dtype``; checkpoints on the hub (and
    older transformers) use the legacy keys.  Writing both keeps loaders of either kind happy;
    transformers 5 reads the file back to the same config.
    """
    data = json.loads(config_path.read_text())
    rope = data.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        data.setdefault("rope_scaling", None if scaling.get("rope_type") == "default" else scaling)
    if "dtype" in data:
        data.setdefault("torch_dtype", data["dtype"])
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a complete tiny HF model directory for ``arch`` to ``out_dir`` and return it.

    The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and
    the tokenizer files of :func:`build_tokenizer`.  ``arch`` is one of :data:`ARCHS`:
    ``llama``, ``llama3`` (llama3 rope scaling), ``mistral``, ``qwen2`` (qkv bias), ``qwen3``
    (q/k norm) or ``smollm2`` (llama with tied embeddings).  Defaults: hidden 64,
    intermediate 128, 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab = len(tokenizer),
    2048 positions, rope_theta 10000, float32.  ``config_overrides`` are passed on to the
    config class and override these defaults (e.g. ``num_hidden_layers=4``).  Weights are
    random but deterministic for a given ``seed``, and scaled so that greedy decoding is
    well separated and not degenerate.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    config_cls, model_cls, arch_kwargs = ARCHS[arch]
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)

    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **arch_kwargs,
        **config_overrides,
    }
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG state alone
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    _reinit_weights(model, torch.Generator().manual_seed(seed))
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    # safetensors is the default (transformers 5 no longer has ``safe_serialization``).
    model.save_pretrained(out_dir)
    _add_legacy_config_keys(out_dir / "config.json")
    return out_dir



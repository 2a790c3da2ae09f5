"""A GGUF model's memory: its blocks once, the KV cache, and nothing else of its size.

A random-weight llama of Llama 3.2 1B's shape (hidden 2048, ff 8192, 16 layers, 32 heads /
8 KV heads of 64; the default model's 49,152-token vocabulary) in a Q4_K_M-like mix (Q4_K,
with Q6_K for the tied ``token_embd`` and every layer's ``attn_v`` and ``ffn_down``): a
705 MB file, written in ~6.5 s on the 2-core reference, so all 16 layers are kept. It is
loaded in a fresh interpreter (``LLM(path, kv_cache_tokens=4096, device="cpu")``, then
again with ``activations="q8"``), which
runs one short greedy generation and reports its VmRSS after loading and after generating,
its VmHWM, the load's seconds, and its anonymous and file-backed RSS (sampled every 10 ms)
for a breakdown.

The bound, for the RSS after loading and after generating, and for the sampled anonymous
peak::

    1.3 x file size + KV reservation + baseline

* the file's blocks are laid once into the kernels' layout, as many bytes as the file holds
  (Q4_1's scales are widened, 1.2x; this file has none); 0.3 x the file is room for the
  norms, the rotary tables, the step's activations and the allocator's slack, far below the
  ~4 GB of a float32 copy or the 705 MB of a second copy of the blocks;
* the KV reservation: ``ModelRunner`` holds one float32 tensor ``[layers, slots, 2 (key,
  value), kv heads, head dim]`` on CPU, slots = ``kv_cache_tokens // block_size *
  block_size``: 16 x 4096 x 2 x 8 x 64 x 4 B = 256 MiB here. It is zero-filled huge-page
  memory (``hugepages.zeros``), written once when the engine starts (``kv_cache_prefault``,
  the default), so all of it is resident from the start, as in a full cache;
* the baseline: what the engine holds before any weight, measured in another fresh
  interpreter doing what ``build_engine`` does first: import torch and freetoken_core, tune
  the allocator, load the native kernels, resolve the model (its config and tokenizer,
  converted into the cache beforehand by this test, so neither child pays for the
  conversion) and load the tokenizer. Its VmRSS is the constant of docs/operations.md's
  formula (~294 MiB here; ``LLM`` itself holds ~35 MiB more before its first weight: the
  plugins and the processor pipeline).

VmHWM is held to that bound too: while the model is built the file is mapped, and every
page of it read counts in the process's RSS as file-backed, so each weight's pages are
dropped (``GGUFWeight.release``, madvise) as soon as its blocks are laid into the arena;
without that the 1B peaked at ~1,730 MiB, the bound plus ~300 MiB (docs/operations.md,
"GGUF memory").

The cache (``FREETOKEN_CACHE``) is a temporary directory whose ``kernels`` is a link to this
session's native-kernel builds (``conftest.py`` builds them at session start), so the child
does not rebuild them; afterwards it holds only the converted config and tokenizer (~3.5 MB),
no weights. Runtime ~20 s on the reference (writing 6.5 s, the children ~13 s). Marked
``slow``; not ``gpu``: it runs the CPU path once, in ``make test``, and ``bench/gpu_check.py``'s
``-m gpu`` runs leave it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_models import Q4_K, Q6_K, write_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]

HIDDEN, FF, LAYERS, HEADS, KV_HEADS = 2048, 8192, 16, 32, 8
HEAD_DIM = HIDDEN // HEADS
KV_TOKENS = 4096
BLOCK_SIZE = 8  # EngineConfig's default
MIX = {"token_embd.weight": Q6_K, "attn_v.weight": Q6_K, "ffn_down.weight": Q6_K}
SLACK = 1.3
MAX_LOAD_S = 120.0
MAX_CACHE_BYTES = 32 << 20
# The default arithmetic (the float32 or the int24 kernel's layout) and the 8-bit
# activations' (its lanes layout, laid as the int24 one is: in place, the tied embedding
# reading the head's blocks): the same bound for both.
ACTIVATIONS = ("auto", "q8")

CHILD = r"""
import json, sys, threading, time

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

stage = ["import"]
peaks = {}

def sample():
    while True:
        s = status()
        p = peaks.setdefault(stage[0], {"RssAnon": 0, "RssFile": 0})
        p["RssAnon"] = max(p["RssAnon"], s["RssAnon"])
        p["RssFile"] = max(p["RssFile"], s["RssFile"])
        time.sleep(0.01)

threading.Thread(target=sample, daemon=True).start()
mode, path, kv_tokens, activations = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
report = {}
import torch  # noqa: F401
import freetoken_core
from freetoken_core.kernels import cpu_kernels_available
if mode == "baseline":
    from freetoken_core.engine.memory import keep_freed_memory
    from freetoken_core.models.resolve import resolve_model
    from freetoken_core.tokenizer import load_tokenizer
    stage[0] = "baseline"
    keep_freed_memory()
    report["native"] = cpu_kernels_available()
    tokenizer = load_tokenizer(resolve_model(path, progress=False))
    tokenizer.encode("Hello, my name is")
    report["baseline"] = status()
else:
    from freetoken_core import SamplingParams
    stage[0] = "load"
    start = time.perf_counter()
    llm = freetoken_core.LLM(path, kv_cache_tokens=kv_tokens, device="cpu", progress=False,
                             activations=activations)
    report["load_s"] = time.perf_counter() - start
    report["native"] = cpu_kernels_available()
    report["after_load"] = status()
    kv = getattr(getattr(llm.engine.core, "runner", None), "kv_caches", None)
    report["kv_bytes"] = None if kv is None else kv.numel() * kv.element_size()
    report["kv_dtype"] = None if kv is None else str(kv.dtype)
    stage[0] = "generate"
    out = llm.generate(["Hello, my name is"],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    report["tokens"] = len(out[0].outputs[0].token_ids)
    report["after_generate"] = status()
time.sleep(0.05)
report["peaks"] = peaks
print("REPORT " + json.dumps(report), flush=True)
"""


def run_child(mode: str, path: Path, env: dict[str, str], activations: str = "auto") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(KV_TOKENS),
                           activations],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{mode} child failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def tree_bytes(root: Path) -> tuple[int, list[tuple[int, str]]]:
    """Bytes of the files under ``root``, not following links (the shared kernel builds),
    and the largest few."""
    files = []
    for dirpath, _, names in os.walk(root):  # os.walk does not descend into linked dirs
        for name in names:
            p = Path(dirpath) / name
            if not p.is_symlink():
                files.append((p.stat().st_size, str(p.relative_to(root))))
    return sum(s for s, _ in files), sorted(files, reverse=True)[:5]


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def test_gguf_model_memory_is_its_blocks_plus_kv_cache(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_core.config import cache_dir
    from freetoken_core.kernels import cpu_kernels_available
    from freetoken_core.models.resolve import resolve_model

    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels are not available: GGUF blocks are dequantized")
    kernels = cache_dir() / "kernels"
    gguf = write_gguf(tmp_path / "llama-1b-q4_k_m.gguf", "llama", hidden=HIDDEN,
                      layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, ff=FF,
                      weight_type=Q4_K, types=MIX, tied=True)
    file_size = gguf.stat().st_size

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
    monkeypatch.setenv("FREETOKEN_CACHE", str(cache))
    resolve_model(gguf, progress=False)  # the config and tokenizer, once, for every child
    env = dict(os.environ)

    base = run_child("baseline", gguf, env)
    for activations in ACTIVATIONS:
        model = run_child("model", gguf, env, activations)
        assert base["native"] and model["native"]
        check_memory(model, base, file_size, activations)

    written, largest = tree_bytes(cache)
    assert written < MAX_CACHE_BYTES, f"{mib(written)} written into the cache: {largest}"


def check_memory(model: dict, base: dict, file_size: int, activations: str) -> None:
    """One model child's report against the bound."""
    slots = KV_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    kv_reserved = LAYERS * slots * 2 * KV_HEADS * HEAD_DIM * 4  # float32 on CPU
    if model["kv_bytes"] is not None:
        assert (model["kv_bytes"], model["kv_dtype"]) == (kv_reserved, "torch.float32")
    baseline = base["baseline"]["VmRSS"]
    bound = SLACK * file_size + kv_reserved + baseline
    after_load, after_gen = model["after_load"], model["after_generate"]
    anon_peak = max(p["RssAnon"] for p in model["peaks"].values())
    peaks = {stage: {k: mib(v) for k, v in p.items()} for stage, p in model["peaks"].items()}
    breakdown = (
        f"--activations {activations}: file {mib(file_size)}, KV reserved "
        f"{mib(kv_reserved)}, baseline {mib(baseline)} -> bound {mib(bound)}; after load {mib(after_load['VmRSS'])} "
        f"(anon {mib(after_load['RssAnon'])}, file {mib(after_load['RssFile'])}), after "
        f"generating {mib(after_gen['VmRSS'])}, VmHWM {mib(after_gen['VmHWM'])}; sampled "
        f"peaks by stage {peaks}; load {model['load_s']:.1f} s")
    print(breakdown)
    assert model["tokens"] == 4
    assert after_load["VmRSS"] <= bound, breakdown
    assert after_gen["VmRSS"] <= bound, breakdown
    assert anon_peak <= bound, breakdown
    # The mapped file's pages are dropped weight by weight while the model is built.
    assert after_gen["VmHWM"] <= bound, breakdown
    assert model["load_s"] < MAX_LOAD_S, breakdown

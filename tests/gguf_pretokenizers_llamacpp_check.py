"""Manual check: FreeToken's GGUF tokenizer against llama.cpp's ``llama-tokenize`` for every
``tokenizer.ggml.pre`` name of :data:`PRE_TOKENIZERS` (not a test: it needs the binary).

Each byte-level name labels the default model's vocabulary (:func:`bpe_tokenizer_gguf`);
each SentencePiece-style one (``gemma4``, ``sarvam-moe`` ...) labels the Gemma 4 test
vocabularies as ``tokenizer.ggml.model = gpt2``. Every text of tests/gguf_tokenizer_cases.py
is tokenized by both (add_special and parse_special, as llama-server tokenizes a prompt) and
the ids compared; the names llama.cpp refuses (an unknown one) or FreeToken refuses
(:data:`REFUSED`) are checked to be refused / accepted by each as said. Then the pieces of
tests/gguf_pretokenizer_probes.py are checked to be llama.cpp's (:func:`llama_cpp_pieces`)
and FreeToken's. Prints one line a name and the totals (names after the binary: only
those)::

    python tests/gguf_pretokenizers_llamacpp_check.py \\
        ~/.cache/freetoken/llama.cpp/build/bin/llama-tokenize [NAME ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gguf_pretokenizer_probes import PROBES
from gguf_tokenizer_cases import (
    _llama_tokenize,
    bpe_tokenizer_gguf,
    case_texts,
    gemma4_tokenizer_gguf,
    special_texts,
    write_tokenizer_gguf,
)
from test_gguf_tokenizer import byte_level_bytes, pieces_of

from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_pretokenizers import PRE_TOKENIZERS, REFUSED
from freetoken_core.models.gguf_reader import open_header
from freetoken_core.models.gguf_tokenizer import build_tokenizer, read_vocab


def files(pre: str, directory: Path) -> list[tuple[str, Path]]:
    """The vocabularies labelled ``pre``: the default model's, or the three Gemma 4 test
    vocabularies as ``gpt2`` ones (``add_bos_token`` false, which llama.cpp overrides for
    its Gemma 4 type only)."""
    if PRE_TOKENIZERS[pre].escape_whitespaces:
        from gguf_gemma4 import VARIANTS

        return [(f"{pre}/{v}", gemma4_tokenizer_gguf(v, directory, False, pre)[0])
                for v in VARIANTS]
    return [(pre, bpe_tokenizer_gguf(pre, directory))]


def compare(binary: Path, name: str, path: Path, scratch: Path) -> tuple[int, int, list[str]]:
    vocab = read_vocab(path, open_header(path))
    tokenizer = build_tokenizer(vocab)
    case = "spmbpe" if vocab.pre_tokenizer.escape_whitespaces else "bpe"
    equal, failures = 0, []
    texts = case_texts(case, special_texts(vocab))
    for key, text in texts.items():
        ours = tokenizer.encode(text, add_special_tokens=True).ids
        theirs = _llama_tokenize(binary, path, text, scratch)
        if ours == theirs:
            equal += 1
            continue
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                 min(len(ours), len(theirs)))
        window = slice(max(i - 3, 0), i + 4)
        failures.append(f"{name} {key}: at {i} ours "
                        f"{[tokenizer.id_to_token(t) for t in ours[window]]} llama.cpp "
                        f"{[tokenizer.id_to_token(t) for t in theirs[window]]}")
    return equal, len(texts), failures


def refusals(binary: Path, scratch: Path) -> list[str]:
    """Each refused name: llama.cpp's verdict and FreeToken's."""
    lines = []
    for pre in ("no-such-pre", *REFUSED):
        path = bpe_tokenizer_gguf(pre, scratch)
        run = subprocess.run([str(binary), "-m", str(path), "-p", "x", "--ids", "--log-disable"],
                             capture_output=True, text=True, check=False)
        try:
            read_vocab(path, open_header(path))
            ours = "built"
        except ModelLoadError as error:
            ours = f"ModelLoadError ({str(error)[len(str(path)) + 2:][:60]}...)"
        lines.append(f"{pre}: llama.cpp {'accepts' if run.returncode == 0 else 'refuses'}, "
                     f"FreeToken {ours}")
    return lines


def llama_cpp_pieces(binary: Path, pre: str, text: str, scratch: Path) -> list[str]:
    """The pieces llama.cpp's pre type ``pre`` cuts ``text`` into: its ids over a vocabulary
    of the byte-level characters and every substring of the (byte-level) text, each made by
    a merge of every two parts of it, so that each piece merges into one token."""
    from gguf import GGUFValueType as T

    to_byte = byte_level_bytes()
    to_char = {b: c for c, b in to_byte.items()}
    chars = "".join(to_char[b] for b in text.encode())
    tokens = [to_char[b] for b in range(256)]
    seen, merges = set(tokens), []
    for start in range(len(chars)):
        for end in range(start + 2, len(chars) + 1):
            piece = chars[start:end]
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece)
                merges += [f"{piece[:cut]} {piece[cut:]}" for cut in range(1, len(piece))]
    fields = [("tokenizer.ggml.model", "gpt2", (T.STRING,)),
              ("tokenizer.ggml.pre", pre, (T.STRING,)),
              ("tokenizer.ggml.tokens", tokens, (T.ARRAY, T.STRING)),
              ("tokenizer.ggml.token_type", [1] * len(tokens), (T.ARRAY, T.INT32)),
              ("tokenizer.ggml.merges", merges, (T.ARRAY, T.STRING)),
              ("tokenizer.ggml.add_bos_token", False, (T.BOOL,))]
    path = write_tokenizer_gguf(fields, scratch / "pieces.gguf")
    ids = _llama_tokenize(binary, path, text, scratch)
    return [bytes(to_byte[c] for c in tokens[i]).decode("utf-8", "replace") for i in ids]


def check_probes(binary: Path, scratch: Path, names: list[str]) -> tuple[int, int, list[str]]:
    equal, total, failures = 0, 0, []
    for pre, probes in PROBES.items():
        if pre not in names:
            continue
        for text, pieces in probes:
            theirs = llama_cpp_pieces(binary, pre, text, scratch)
            ours = pieces_of(PRE_TOKENIZERS[pre], text)
            total += 1
            if theirs == pieces == ours:
                equal += 1
            else:
                failures.append(f"probe {pre} {text!r}: recorded {pieces}, llama.cpp {theirs}, "
                                f"FreeToken {ours}")
    return equal, total, failures


def main(binary: Path, names: list[str]) -> int:
    names = names or sorted(PRE_TOKENIZERS)
    total_equal = total = 0
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for pre in names:
            for name, path in files(pre, scratch):
                equal, count, failed = compare(binary, name, path, scratch)
                total_equal += equal
                total += count
                failures += failed
                print(f"{name}: {equal}/{count} texts equal", flush=True)
                path.unlink()
        print(*refusals(binary, scratch), sep="\n")
        probes_equal, probes, failed = check_probes(binary, scratch, names)
    print(*failures, *failed, sep="\n")
    print(f"{len(names)} names, {total_equal}/{total} (file, text) pairs equal; "
          f"{probes_equal}/{probes} probes cut as recorded by llama.cpp and FreeToken")
    return 0 if total_equal == total and probes_equal == probes else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).expanduser(), sys.argv[2:]))

"""The ``freetoken`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from freetoken_core.errors import FreeTokenError


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)


def _engine_options(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_tokens": args.kv_cache_tokens,
    }


def _generate(args: argparse.Namespace) -> int:
    from freetoken_core.config import EngineConfig
    from freetoken_core.engine.llm_engine import LLMEngine
    from freetoken_core.sampling_params import SamplingParams
    from freetoken_core.tokenizer import apply_chat_template

    engine = LLMEngine(EngineConfig(model=args.model, **_engine_options(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    prompt = args.prompt
    if not args.raw and getattr(engine.tokenizer, "chat_template", None):
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests:
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    _add_engine_options(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FreeTokenError as exc:
        print(f"freetoken: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

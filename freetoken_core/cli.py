"""The ``freetoken`` command line.

    freetoken generate PROMPT [--plugins LIST] [--param FIELD=VALUE ...] [engine options]

Engine options include ``--generation-config auto|none|PATH`` and
``--override-generation-config JSON``: defaults for the sampling fields a request leaves
unset (docs/operations.md, "Generation defaults").
    freetoken serve [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                    [--api-key KEY] [CORS options] [request limits] [engine options]
    freetoken plugins [--json] [--plugins LIST]
    freetoken bench plugin NAME [--batch B --vocab V --history H --device D --steps N
                                 --model M]

``--plugins`` is ``all`` (the default), ``none`` or a comma-separated list of installed
plugin names; without it, ``FREETOKEN_PLUGINS`` does the same. A name that is not
installed is a start-up error (exit status 2) listing the installed plugins.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from freetoken_core.errors import FreeTokenError, InvalidRequest

if TYPE_CHECKING:
    from freetoken_core.server.cors import CorsSettings

GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
"""What ``freetoken generate`` uses for an option given neither on its command line nor by
the generation defaults: greedy, 256 tokens."""
PLUGINS_HELP = ("plugins to enable: all (default), none, or a comma-separated list of "
                "installed plugin names; default: $FREETOKEN_PLUGINS, else all")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--activations", default="auto",
                        choices=["auto", "float32", "int24", "q8"],
                        help="CPU linears of a GGUF model. Exact: float32 (float32 FMAs) or "
                             "int24 (24-bit fixed-point activations, integer dot products on "
                             "AVX-512 VNNI / AMX); auto (default): int24 where the CPU has "
                             "AVX-512 VNNI, else float32. Opt-in, not exact: q8 (8-bit "
                             "activations as llama.cpp computes them; Q4_0, Q4_1, Q5_0, "
                             "Q8_0, Q4_K, Q5_K and Q6_K linears, the others keep float32). int24 "
                             "computes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/"
                             "IQ4_XS/MXFP4 "
                             "linears (the others, F16/BF16 and the IQ1/IQ2/IQ3 i-quants, "
                             "keep float32); "
                             "both need the native kernels")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-tokens", type=int, default=32768)
    parser.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="write the whole KV cache once at start, so that its memory is "
                             "resident before the first request instead of faulting in "
                             "during decode steps (CPU; default: on)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "float32", "float16", "bfloat16"],
                        help="how the KV cache stores keys and values: auto (default) the "
                             "model's dtype (float32 on CPU: exact); float16 (as llama.cpp) "
                             "or bfloat16 take half the memory and round each key and value "
                             "once, so they are not exact")
    parser.add_argument("--block-size", type=int, default=8, metavar="N",
                        help="token slots per KV-cache block, also the grain at which "
                             "requests share a cached prefix (default: 8)")
    parser.add_argument("--plugins", default=None, metavar="LIST", help=PLUGINS_HELP)
    parser.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                        help="a Jinja chat template (a file, or the template text) that "
                             "replaces the model's, e.g. for a GGUF file that has none")
    parser.add_argument("--generation-config", default="auto", metavar="auto|none|PATH",
                        help="defaults for the sampling fields a request leaves unset: auto "
                             "(the model directory's generation_config.json, if any), none, "
                             "or a directory holding generation_config.json, or the file "
                             "(default: auto)")
    parser.add_argument("--override-generation-config", default=None, type=_json_object,
                        metavar="JSON",
                        help="a JSON object of generation-config keys that win over the "
                             "file's, key by key, e.g. '{\"temperature\": 0.5}'")
    parser.add_argument("--hf-overrides", default=None, type=_json_object, metavar="JSON",
                        help="a JSON object of config.json keys that replace the model's "
                             "(vLLM's flag), e.g. Qwen's YaRN: '{\"rope_scaling\": "
                             "{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                             "\"original_max_position_embeddings\": 32768}}'")
    _add_parallel_options(parser)
    from freetoken_core.plugins import PluginManager

    # Every installed plugin's own options (freetoken_add_cli_options), one group each.
    PluginManager().add_cli_options(parser)


def _add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism's flags, vLLM's names (docs/operations.md, "Past one machine")."""
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="split the model over N ranks, one process each (default: 1)")
    group.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                       help="mp: rank 0 starts its node's ranks, other nodes run "
                            "--headless; ray: one actor per rank on the running Ray cluster "
                            "(default: mp)")
    group.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes the ranks are spread over with mp (default: 1)")
    group.add_argument("--node-rank", type=int, default=0, metavar="I",
                       help="this node's index; 0 serves HTTP (default: 0)")
    group.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                       help="rank 0's address for the group to meet (default: 127.0.0.1)")
    group.add_argument("--master-port", type=int, default=0, metavar="PORT",
                       help="its port; 0 picks a free one on one node (default: 0)")
    group.add_argument("--distributed-timeout", type=float, default=60.0, metavar="S",
                       help="seconds a rank waits for the others in one step or for the "
                            "group to form before the group counts as broken (default: 60)")


def _add_limit_options(serve: argparse.ArgumentParser) -> None:
    """One flag per ``RequestLimits`` field (docs/operations.md, "Limits")."""
    from freetoken_core.server.limits import RequestLimits

    d = RequestLimits()
    group = serve.add_argument_group("request limits (a request over one is a 400; body: 413)")
    for flag, dest, default, help_ in [
        ("--max-stop-strings", "max_stop_strings", d.max_stop_strings, "stop strings"),
        ("--max-stop-string-chars", "max_stop_string_chars", d.max_stop_string_chars,
         "characters in one stop string"),
        ("--max-prompts", "max_prompts", d.max_prompts, "prompts in one completions request"),
        ("--max-sequences", "max_sequences", d.max_sequences, "prompts × n"),
        ("--max-prompt-chars", "max_prompt_chars", d.max_prompt_chars,
         "characters of prompt text, before tokenization"),
        ("--max-cache-salt-chars", "max_cache_salt_chars", d.max_cache_salt_chars,
         "characters of cache_salt"),
        ("--max-prompt-logprobs", "max_prompt_logprobs", d.max_prompt_logprobs,
         "prompt-logprob entries: prompt tokens × (alternatives + 1) × n"),
        ("--max-body-bytes", "max_body_bytes", d.max_body_bytes, "bytes of request body"),
        ("--tokenizer-threads", "num_tokenizer_threads", d.num_tokenizer_threads,
         "worker threads that tokenize and render chat templates (not a per-request limit)"),
        ("--idle-priority-chars", "idle_priority_chars", d.idle_priority_chars,
         "a text above this is encoded in a process at idle CPU priority (not a limit)"),
    ]:
        group.add_argument(flag, dest=dest, type=int, default=default, metavar="N",
                           help=f"{help_} (default: {default})")


def _engine_options(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "device": args.device,
        "activations": args.activations,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_tokens": args.kv_cache_tokens,
        "kv_cache_prefault": args.kv_cache_prefault,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "plugins": args.plugins,
        "plugin_options": {k: v for k, v in vars(args).items() if not callable(v)},
        "generation_config": args.generation_config,
        "override_generation_config": args.override_generation_config or {},
        "hf_overrides": args.hf_overrides,
        "chat_template": args.chat_template,
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "distributed_timeout": args.distributed_timeout,
        "pin_ranks": getattr(args, "pin_threads", True),
    }


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (``--override-generation-config``,
    ``--hf-overrides``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"temperature\": 0.5}'")
    return value


def _parse_param(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE`` with VALUE as JSON when it parses (``0.1``, ``{"42": 5}``), else text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _generate(args: argparse.Namespace) -> int:
    from freetoken_core.config import EngineConfig
    from freetoken_core.engine.llm_engine import LLMEngine
    from freetoken_core.sampling_params import SamplingParams
    from freetoken_core.tokenizer import apply_chat_template

    core = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_tokens": args.max_tokens, "seed": args.seed, "stop": args.stop}
    extra = dict(args.param or [])
    clash = sorted(extra.keys() & core.keys())
    if clash:
        raise InvalidRequest(clash[0], f"--param {clash[0]}: use --{clash[0].replace('_', '-')}")
    # Options left out are unset: the generation defaults fill them, then this command's own.
    params = SamplingParams(**{k: v for k, v in core.items() if v is not None}, **extra)
    engine = LLMEngine(EngineConfig(model=args.model, **_engine_options(args)))
    params = engine.generation_defaults.apply(params, fallback=GENERATE_DEFAULTS)
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


def _add_cors_options(serve: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags; each list is JSON (``'["https://a.example"]'``) or ``a,b``."""
    group = serve.add_argument_group(
        "CORS (off unless --allowed-origins is given; preflights pass the --api-key check)")
    group.add_argument("--allowed-origins", default=None, metavar="LIST",
                       help="browser origins allowed, or * for any (default: none, no CORS)")
    group.add_argument("--allowed-methods", default=None, metavar="LIST",
                       help="HTTP methods allowed (default: *)")
    group.add_argument("--allowed-headers", default=None, metavar="LIST",
                       help="request headers allowed (default: *)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="send Access-Control-Allow-Credentials: true (needs explicit "
                            "origins; default: off)")


def _cors_settings(args: argparse.Namespace) -> CorsSettings | None:
    """The ``CorsSettings`` of the CORS flags, ``None`` without ``--allowed-origins``."""
    from freetoken_core.server.cors import CorsSettings, CorsSettingsError, parse_list

    if args.allowed_origins is None:
        given = [flag for flag, value in [("--allowed-methods", args.allowed_methods),
                                          ("--allowed-headers", args.allowed_headers),
                                          ("--allow-credentials", args.allow_credentials or None)]
                 if value is not None]
        if given:
            raise CorsSettingsError(f"{', '.join(given)} needs --allowed-origins")
        return None
    return CorsSettings(
        allowed_origins=parse_list(args.allowed_origins),
        allowed_methods=parse_list(args.allowed_methods or "*"),
        allowed_headers=parse_list(args.allowed_headers or "*"),
        allow_credentials=args.allow_credentials)


def _add_restart_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-restart-delay", type=float, default=0.5, metavar="S",
                        help="seconds before a new engine process starts after one died; "
                             "doubles per consecutive crash (default: 0.5)")
    parser.add_argument("--engine-restart-max-delay", type=float, default=30.0, metavar="S",
                        help="the longest wait between engine restarts (default: 30)")
    parser.add_argument("--pin-threads", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's main thread on a CPU of its own, its OpenMP workers "
                             "and the HTTP process on the others (needs 2+ CPUs; Linux; "
                             "default: on); with --tensor-parallel-size, each rank on CPUs "
                             "of its own")


def _set_log_level(level: str) -> None:
    """FreeToken's own log lines (the generation defaults, warnings) at the ``--log-level``
    chosen; Litestar's root handler prints them."""
    import logging

    logging.getLogger("freetoken").setLevel(level.upper())


def _serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until SIGINT/SIGTERM; the engine process is
    stopped and joined before this returns. Exit status 2 when the model fails to load."""
    import uvicorn

    from freetoken_core.config import EngineConfig
    from freetoken_core.engine.client import RestartPolicy
    from freetoken_core.plugins import PluginManager
    from freetoken_core.server.app import ServerConfig, create_app
    from freetoken_core.server.limits import RequestLimits

    _set_log_level(args.log_level)
    engine_config = EngineConfig(model=args.model, **_engine_options(args))
    if args.headless:
        from freetoken_core.engine.tensor_parallel import run_headless

        return run_headless(engine_config)
    # A bad --plugins, or an option a plugin refuses, fails here.
    PluginManager(engine_config.plugins, engine_config.plugin_options).enabled  # noqa: B018
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    limits = RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
    restart = RestartPolicy(args.engine_restart_delay, args.engine_restart_max_delay)
    config = ServerConfig(engine_config, args.served_model_name, api_key=args.api_key,
                          limits=limits, cors=_cors_settings(args), restart=restart,
                          pin_threads=args.pin_threads)
    app = create_app(config, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=5))
    # torch, transformers and Litestar live as long as the server: keep the cyclic
    # collector off them, so that a full collection does not stall the streams for long.
    gc.collect()
    gc.freeze()
    server.run()
    return 2 if failures else 0


def _plugins(args: argparse.Namespace) -> int:
    from freetoken_core.plugins import PluginManager

    infos = [asdict(info) for info in PluginManager(args.plugins).describe()]
    if args.json:
        print(json.dumps(infos, indent=2))
        return 0
    if not infos:
        print("no plugins installed")
        return 0
    short = [{
        "name": i["name"],
        "enabled": "yes" if i["enabled"] else "no",
        "distribution": f"{i['distribution'] or '-'} {i['version'] or ''}".strip(),
        "kind": i["kind"],
        "fields": ", ".join(i["fields"]) or "-",
        "hooks": ", ".join(h.removeprefix("freetoken_") for h in i["hooks"]) or "-",
    } for i in infos]
    columns = list(short[0])
    widths = {c: max(len(c), *(len(row[c]) for row in short)) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for row in short:
        print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
    return 0


def _bench_plugin(args: argparse.Namespace) -> int:
    from freetoken_core.bench import BenchShape, run_plugin_bench

    shape = BenchShape(batch=args.batch, vocab=args.vocab, history=args.history,
                       device=args.device)
    print(run_plugin_bench(args.name, shape, num_steps=args.steps, model=args.model).table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="default: the generation defaults', else 256")
    gen.add_argument("--temperature", type=float, default=None,
                     help="default: the generation defaults', else 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="default: the generation defaults', else 1")
    gen.add_argument("--top-k", type=int, default=None,
                     help="default: the generation defaults', else -1 (off)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--param", action="append", type=_parse_param, metavar="FIELD=VALUE",
                     help="a plugin request field, VALUE as JSON, e.g. my_field=0.1 (repeatable)")
    _add_engine_options(gen)
    gen.set_defaults(func=_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--headless", action="store_true",
                       help="serve no HTTP: run this node's tensor-parallel ranks for the "
                            "group whose rank 0 is at --master-addr (--node-rank >= 1)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name clients use (default: the --model argument)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    _add_engine_options(serve)
    _add_limit_options(serve)
    _add_cors_options(serve)
    _add_restart_options(serve)
    serve.set_defaults(func=_serve)

    plugins = commands.add_parser("plugins", help="list the installed plugins")
    plugins.add_argument("--json", action="store_true",
                         help="print a JSON list of {name, distribution, version, enabled, "
                              "hooks, processors, fields}")
    plugins.add_argument("--plugins", default=None, metavar="LIST", help=PLUGINS_HELP)
    plugins.set_defaults(func=_plugins)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    plugin = bench_kinds.add_parser(
        "plugin", help="per-step sampler cost of a plugin: plain, enabled-unused, active")
    plugin.add_argument("name", metavar="NAME", help="an installed plugin, or all")
    plugin.add_argument("--batch", type=int, default=64)
    plugin.add_argument("--vocab", type=int, default=151_936)
    plugin.add_argument("--history", type=int, default=3000,
                        help="prompt tokens per row handed to the processors")
    plugin.add_argument("--device", default="cpu")
    plugin.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    plugin.add_argument("--model", default=None,
                        help="the model whose tokenizer and EOS ids the processors get (its "
                             "weights are not loaded; default: the embedded "
                             "SmolLM2-135M-Instruct)")
    plugin.set_defaults(func=_bench_plugin)
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

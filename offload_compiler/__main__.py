"""Command line: ``python -m offload_compiler demo`` (also the ``trinity`` console script)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m offload_compiler COMMAND [options]

commands:
  demo       train a character-level GPT with and without trinity and compare (the main job)
  plan       will a model's training step fit a GPU, and how fast? (fake tensors, no GPU needed)
  calibrate  measure this machine's FLOP/s and bandwidths for the cost model (JSON)

Run a command with --help for its options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "plan":
        from .plan_cli import main as plan_main

        return plan_main(rest)
    if command == "calibrate":
        from .calibrate import main as calibrate_main

        return calibrate_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

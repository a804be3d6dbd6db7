"""``python -m bench`` (``make bench``): the benchmark suite (every method on every model, the
planner benches, then ``bench/results/README.md`` and the frontier PNGs). ``--help`` for options."""

import sys

from .suite import main

if __name__ == "__main__":
    sys.exit(main())

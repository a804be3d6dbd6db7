"""trinity's benchmarks. ``python -m bench`` (``make bench``) runs the CPU suite."""

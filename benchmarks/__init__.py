"""Reproducible benchmarks (JSON out); each module also runs as a script."""

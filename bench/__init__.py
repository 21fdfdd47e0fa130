"""Benchmarks: pytest-benchmark suites and GPU entry points (``python -m bench.gpu_decode``)."""

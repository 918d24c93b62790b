"""Reproducible benchmarks: run each as ``python -m benchmarks.NAME`` from a checkout (or ``deltarl bench NAME``)."""

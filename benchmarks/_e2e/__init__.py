"""Parts of the multi-region end-to-end benchmark (``benchmarks/e2e.py``)."""

"""Shared pytest configuration. Fixtures live in plugin modules under tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.servers",  # S3 servers: moto (ThreadedMotoServer) and SeaweedFS, port 0
    "tests.fixtures.runs",  # small published runs in a store
    "tests.fixtures.relays",  # relays on loopback
    "tests.fixtures.nginx",  # a real nginx as a caching relay (skipped without it, except in CI)
    "tests.fixtures.plain_http",  # a plain HTTP object server (no long-poll), counting requests
    "tests.fixtures.coordinator",  # coordinator service on loopback
    "tests.fixtures.models",  # tiny transformers models and tokenizer
    "tests.fixtures.codec_warmup",  # numba's kernels compiled once, before pytest-xdist's workers start
]

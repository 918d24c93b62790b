"""Every default address and path, and every environment variable deltarl reads, in one place.

Processes take these as their defaults (configs, command-line flags, docs); change one here and
every process agrees. The relay and the coordinator listen on different ports, so both can run
with default flags on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# --- addresses and paths ------------------------------------------------------------------------

#: Where a local run's store lives when no ``--store`` is given (a folder, relative to the cwd).
STORE = "./deltarl-runs"
#: Default port of ``deltarl relay``.
RELAY_PORT = 8470
#: Default listen address of ``deltarl relay`` (loopback: expose it deliberately).
RELAY_LISTEN = f"127.0.0.1:{RELAY_PORT}"
#: Default port of ``deltarl coordinator`` (not the relay's: both may run on one host).
COORDINATOR_PORT = 8480
#: Default bind address of ``deltarl coordinator``.
COORDINATOR_HOST = "127.0.0.1"
#: Default coordinator URL of the trainer and the actors.
COORDINATOR_URL = f"http://{COORDINATOR_HOST}:{COORDINATOR_PORT}"

# --- timeouts -----------------------------------------------------------------------------------

#: Seconds a relay client (``HTTPStore``, ``RelayClient`` and the async sources over them) waits
#: for the next bytes of a relay's answer before it counts the connection as failed: as long as a
#: relay holds a long-poll by default (``RelayConfig.max_wait_s``) and forwards a large write
#: upstream. The actor's fetcher passes its own, shorter one to fail over sooner.
RELAY_READ_TIMEOUT_S = 120.0

# --- environment variables ----------------------------------------------------------------------

#: Bearer token valid for both actors and the trainer at the coordinator.
COORDINATOR_TOKEN_ENV = "DELTARL_COORDINATOR_TOKEN"
#: The actor's coordinator token (before ``COORDINATOR_TOKEN_ENV``).
ACTOR_TOKEN_ENV = "DELTARL_ACTOR_TOKEN"
#: The trainer's coordinator token (before ``COORDINATOR_TOKEN_ENV``).
TRAINER_TOKEN_ENV = "DELTARL_TRAINER_TOKEN"
#: Token a relay requires for pushes (PUT/DELETE).
RELAY_TOKEN_ENV = "DELTARL_RELAY_TOKEN"
#: Token a relay presents when it forwards pushes to an upstream relay.
UPSTREAM_TOKEN_ENV = "DELTARL_UPSTREAM_TOKEN"
#: S3 endpoint (MinIO, SeaweedFS); the AWS variables after it are the standard fallbacks.
S3_ENDPOINT_ENV = "DELTARL_S3_ENDPOINT"
S3_ENDPOINT_ENVS = (S3_ENDPOINT_ENV, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
#: Set to a non-empty value other than ``0``: the pure-numpy codec path instead of numba.
NO_NUMBA_ENV = "DELTARL_NO_NUMBA"
#: Threads of the chunk-parallel codec (default min(4, CPU count)).
THREADS_ENV = "DELTARL_THREADS"

#: Test machinery only (read by :mod:`deltarl.testing.faults`, never by a product path):
#: ``<version>:<stage>[:<k>]`` kills a publishing test process at that stage.
TEST_CRASH_AT_ENV = "DELTARL_TEST_CRASH_AT"

ACTOR_TOKEN_ENVS = (ACTOR_TOKEN_ENV, COORDINATOR_TOKEN_ENV)
TRAINER_TOKEN_ENVS = (TRAINER_TOKEN_ENV, COORDINATOR_TOKEN_ENV)


def first_env(names: Sequence[str]) -> str | None:
    """The value of the first of ``names`` that is set to a non-empty string, else ``None``."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)

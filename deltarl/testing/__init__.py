"""deltarl.testing: machinery for tests and benchmarks, never on a production code path.

* :mod:`~deltarl.testing.wan` - ``EmulatedLink``: a rootless WAN emulator (delay, window, rate, faults)
* :mod:`~deltarl.testing.fleet` - a simulated actor fleet in virtual time for the scheduler
* :mod:`~deltarl.testing.faults` - ``CrashAt``: the publisher hook that SIGKILLs a test process mid-publish
* :mod:`~deltarl.testing.ranks` - ``spawn_ranks`` / ``leave_process_group``: run spawned gloo ranks and end
  them without the teardown abort
* :mod:`~deltarl.testing.store_tests` - ``StoreTests``: the ObjectStore conformance suite every
  backend subclasses (needs pytest)
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "store_tests": ("StoreTests",),
    "wan": ("EmulatedLink",),
})

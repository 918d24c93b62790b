"""deltarl.testing: machinery for tests and benchmarks, never on a production code path.

* :mod:`~deltarl.testing.wan` - ``EmulatedLink``: a rootless WAN emulator (delay, window, rate, faults)
* :mod:`~deltarl.testing.fleet` - a simulated actor fleet in virtual time for the scheduler
"""

"""``deltarl demo``: the whole loop as a multi-process deployment on one machine (runner, live view, report).

The demo is the CLI's ``deltarl demo``, not a Python API: nothing is exported here.
"""

__all__: list[str] = []

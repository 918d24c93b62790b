"""``deltarl demo``: the whole loop as a multi-process deployment on one machine (runner, live view, report)."""

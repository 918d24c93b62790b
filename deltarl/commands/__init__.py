"""One module per ``deltarl`` subcommand: ``HELP``, ``add_arguments(parser)``, ``run(args) -> int``.

The commands are the CLI's surface, not a Python API: nothing is exported here.
"""

__all__: list[str] = []

"""One module per ``deltarl`` subcommand: ``HELP``, ``add_arguments(parser)``, ``run(args) -> int``."""

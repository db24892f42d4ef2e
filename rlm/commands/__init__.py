"""Subcommands of the `rlm` CLI.

Each module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. They are imported only
when their subcommand is called, so `rlm --help` stays fast (torch and transformers are not imported).
"""

"""Subcommands of the `rlm` CLI.

Each module defines `add_arguments(parser)` and `run(args) -> int`; its one-line help is in `rlm.cli.COMMANDS`.
They are imported only when their subcommand is called, so `rlm --help` stays fast (torch and transformers are
not imported).
"""

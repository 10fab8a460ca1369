"""Subcommands of the ``multistream`` command line, one module each (see ``multistream.cli``)."""

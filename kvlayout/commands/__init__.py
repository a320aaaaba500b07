"""Subcommands of the ``kvlayout`` command line, one module each (registered in ``kvlayout.cli``)."""

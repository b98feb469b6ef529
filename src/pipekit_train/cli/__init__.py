"""The ``pipekit-train`` command line. `main` is the console script; each command imports what it needs when it
runs, so ``--help``, ``--version``, ``artifacts`` and ``runs`` never load JAX."""

from ._main import main as main

"""``python -m pipekit_train.cli``: the same as the ``pipekit-train`` command."""

import sys

from . import main

sys.exit(main())

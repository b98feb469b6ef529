"""``python -m pipekit_train.adapters.conformance NAME [--import MODULE] [--check NAME]``: every check against one
backend, one line each (`main`)."""

import sys

from ._main import main

sys.exit(main())

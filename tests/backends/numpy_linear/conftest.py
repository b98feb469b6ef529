"""Make this folder's backend importable as ``numpy_linear`` (what ``--import numpy_linear`` names)."""

from __future__ import annotations

import sys
from pathlib import Path

BACKENDS = str(Path(__file__).resolve().parent.parent)
if BACKENDS not in sys.path:
    sys.path.insert(0, BACKENDS)

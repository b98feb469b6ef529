"""Checkpoints: when to write them (`Checkpoint`), which to keep (selectors), the `Checkpointer` that writes and
reads them with Orbax, averaging, listing runs, and the hooks that resume a stage exactly.

One checkpoint is one Orbax step directory holding the arrays, the data position and JSON meta, committed together;
``manifest.json`` beside the steps lists what is kept. See ``docs/checkpoints.md`` and ``design/checkpoints.md``.
"""

from ._average import average_checkpoints as average_checkpoints
from ._average import write_average as write_average
from ._checkpointer import Checkpointer as Checkpointer
from ._errors import CheckpointCorruptedError as CheckpointCorruptedError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointMismatchError as CheckpointMismatchError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CheckpointSaveError as CheckpointSaveError
from ._layout import HeldState as HeldState
from ._runs import format_runs_table as format_runs_table
from ._runs import list_runs as list_runs
from ._selectors import Average as Average
from ._selectors import Best as Best
from ._selectors import Every as Every
from ._selectors import Last as Last
from ._selectors import ManifestEntry as ManifestEntry
from ._selectors import Selector as Selector
from ._settings import Checkpoint as Checkpoint

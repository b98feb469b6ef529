"""The conformance kit's registry of checks (`CHECKS`, the public API) and its command line, ``python -m
pipekit_train.adapters.conformance NAME``, which runs them against one backend and reports one line per check.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._cli import check_runs_a_yaml_pipeline_from_the_cli
from ._handoff import check_hands_off_in_a_sequential, check_refuses_a_foreign_model, check_transfers_by_paths
from ._problem import _capabilities
from ._records import check_records_artifacts, check_round_trips_the_model_registry
from ._resume import check_keeps_checkpoints_by_selectors, check_restores_the_best_checkpoint, check_resumes_exactly
from ._training import check_calls_callbacks_in_order, check_is_deterministic, check_returns_a_trained_model

CHECKS: dict[str, Callable[[str, Path], None]] = {
    "returns_a_trained_model": check_returns_a_trained_model,
    "is_deterministic": check_is_deterministic,
    "calls_callbacks_in_order": check_calls_callbacks_in_order,
    "resumes_exactly": check_resumes_exactly,
    "transfers_by_paths": check_transfers_by_paths,
    "restores_the_best_checkpoint": check_restores_the_best_checkpoint,
    "keeps_checkpoints_by_selectors": check_keeps_checkpoints_by_selectors,
    "records_artifacts": check_records_artifacts,
    "round_trips_the_model_registry": check_round_trips_the_model_registry,
    "hands_off_in_a_sequential": check_hands_off_in_a_sequential,
    "refuses_a_foreign_model": check_refuses_a_foreign_model,
    "runs_a_yaml_pipeline_from_the_cli": check_runs_a_yaml_pipeline_from_the_cli,
}


def main(argv: list[str] | None = None) -> int:
    """Run every check against one backend; print one line per check; exit 1 if any failed."""
    parser = argparse.ArgumentParser(
        prog="python -m pipekit_train.adapters.conformance", description="Check a backend adapter's contract."
    )
    parser.add_argument("backend", metavar="NAME", help="the backend's registered name")
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (a module that calls pipekit_train.register_backend)",
    )  # fmt: skip
    parser.add_argument("--check", action="append", choices=sorted(CHECKS), help="run only this check (repeatable)")
    args = parser.parse_args(argv)
    for name in args.imports:
        importlib.import_module(name)
    _capabilities(args.backend)  # an unknown or uninstalled backend is one clear error, before any check runs
    selected = {name: CHECKS[name] for name in args.check} if args.check else CHECKS
    failed = 0
    for name, check in selected.items():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                check(args.backend, Path(tmp))
            except AssertionError as e:
                failed, outcome = failed + 1, f"FAIL {name}: {e}"
            except Exception as e:
                failed, outcome = failed + 1, f"FAIL {name}: {type(e).__name__}: {e}"
            else:
                outcome = f"ok   {name}"
        print(f"{outcome} ({time.perf_counter() - started:.1f}s)", flush=True)
    print(f"{len(selected) - failed} passed, {failed} failed")
    return 1 if failed else 0

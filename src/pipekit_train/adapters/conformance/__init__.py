"""Conformance checks every backend adapter must pass, whatever its framework.

Run them from the shell (``--import`` loads a backend that registers itself in-process with `register_backend`)::

    python -m pipekit_train.adapters.conformance NAME [--import MODULE]

or from a test suite through `CHECKS`, the public API: ``{check name: check(backend_name, tmp_dir)}``. A check
returns ``None`` when the backend conforms and raises `AssertionError` naming the backend and what differed when it
does not; it writes only under ``tmp_dir`` (a fresh directory per check)::

    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_conformance(check, tmp_path):
        CHECKS[check]("my-backend", tmp_path)

Every check trains a tiny regression problem (96 examples of 4 features, a linear target, 30 steps of 16; every stage
of every check as long, so that a sampler compiles one program for all of them) the way users do, through
`TrainingLoop`, `pipekit.Sequential` and the CLI, with validation every 10 steps. The model is the backend's own
``example_model(4, 1)`` (see ``adapters/README.md``), the loss `MSE` and the optimizer SGD with momentum under a
warm-up cosine schedule (``schedule: warmup_cosine``, 5 warm-up steps: `pipekit_train.optim.schedule_numbers` gives
its numbers; `pipekit_train.backends.kit.learning_rate_at` the rate at a step), which every backend with the ``weights``
capability is expected to honour. A backend that trains otherwise (a sampler, a variational fit) gives the loop
fields of its own problem on the same data with ``example_fields()`` (a kernel as `task`, an ELBO as `loss`), and
every check gives it the **sampler variant**: the same checks where they mean something (determinism, SIGTERM and
a bitwise resume, retention, artifacts and lineage, the registry round trip, the hand-off to a next stage, refusing
a foreign model, the CLI), each judged by what the backend is. The backend
must be registered in this process before a check runs (an installed entry point, or the module that calls
`register_backend` imported first).

The checks:

- ``returns_a_trained_model``: a bound model of the loop's architecture, and the logged training loss went down.
- ``is_deterministic``: one seed gives bitwise the same weights twice; another seed gives other weights.
- ``calls_callbacks_in_order``: start, one ``on_step_end`` per step with the right step, evaluations, end.
- ``resumes_exactly``: a run stopped by SIGTERM between two evaluations and resumed ends bitwise where an
  uninterrupted run ends (weights, callbacks' saved state, logged history), with `ReduceLROnPlateau` and
  `EarlyStopping` acting on the evaluations where the backend trains weights.
- ``restores_the_best_checkpoint``: with ``restore_best``, the returned weights are the best checkpoint's and the
  artifact records that step's validation metrics and the step (``restored``).
- ``transfers_by_paths``: with the ``transfer`` capability, ``Transfer(paths=example_transfer())`` starts a second
  stage from the first stage's weights in those parts and fresh weights elsewhere.
- ``keeps_checkpoints_by_selectors``: ``keep=(Last(n=2),)`` leaves exactly the last two steps on disk and in
  ``manifest.json``, and a warm start (``init_from``) from the latest one starts from the final weights.
- ``records_artifacts``: one artifact per stage in a SQLite `ArtifactStore`, with the backend's name, its
  `backend_info` and the parent link between stages.
- ``round_trips_the_model_registry``: `load_model` of the artifact's URI gives an equal operator with the same
  weights hash and the same predictions.
- ``hands_off_in_a_sequential``: the second stage of a `Sequential` starts from the first stage's final weights
  (a sampler: from the first stage's posterior, as its artifact says, with the first stage as its parent).
- ``refuses_a_foreign_model``: pre-flight refuses, with a `pipekit.ConfigError`, a model of another backend.
- ``runs_a_yaml_pipeline_from_the_cli``: ``pipekit-train validate`` and ``run`` of a two-stage YAML pipeline in a
  subprocess (with ``--import MODULE`` for an in-process backend) record both stages, with bitwise the weights the
  same pipeline gets in this process.

The kit's modules, one idea each: ``_problem`` (the problem every check trains), ``_training`` (a trained model,
determinism, the callbacks' order), ``_resume`` (resume, the best checkpoint, retention), ``_handoff`` (transfer,
the hand-off in a `Sequential`, a foreign model refused), ``_records`` (artifacts, the model registry), ``_cli`` (a
YAML pipeline from the command line) and ``_main`` (`CHECKS` and ``python -m``).
"""

from __future__ import annotations

from ._cli import check_runs_a_yaml_pipeline_from_the_cli as check_runs_a_yaml_pipeline_from_the_cli
from ._handoff import check_hands_off_in_a_sequential as check_hands_off_in_a_sequential
from ._handoff import check_refuses_a_foreign_model as check_refuses_a_foreign_model
from ._handoff import check_transfers_by_paths as check_transfers_by_paths
from ._main import CHECKS, main
from ._records import check_records_artifacts as check_records_artifacts
from ._records import check_round_trips_the_model_registry as check_round_trips_the_model_registry
from ._resume import check_keeps_checkpoints_by_selectors as check_keeps_checkpoints_by_selectors
from ._resume import check_restores_the_best_checkpoint as check_restores_the_best_checkpoint
from ._resume import check_resumes_exactly as check_resumes_exactly
from ._training import check_calls_callbacks_in_order as check_calls_callbacks_in_order
from ._training import check_is_deterministic as check_is_deterministic
from ._training import check_returns_a_trained_model as check_returns_a_trained_model

__all__ = ["CHECKS", "main"]  # and each check by its name, as when the kit was one module

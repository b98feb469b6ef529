"""The backends that ship with pipekit-train, one package per backend, and the conformance kit.

`TrainingLoop(backend=NAME)` finds its backend object by name (the ``pipekit_train.backends`` entry-point group,
or `pipekit_train.register_backend`); nothing here is imported until a stage names a backend. What a backend
implements, and what every backend may use, is public in `pipekit_train.backends` (the contract `Backend` and
`StepBackend`, `ModelOp`) and `pipekit_train.backends.kit` (what the backends share); the conformance checks are
`pipekit_train.adapters.conformance`. The repository's ``adapters/README.md`` describes all of it.
"""

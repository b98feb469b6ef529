"""Backend adapters: one module per backend, each importing its framework lazily.

`TrainingLoop` finds an adapter through `pipekit_train._loop._BACKEND_MODULES`. The adapter contract and a template
for writing one are in the repository's top-level ``adapters/`` folder.
"""

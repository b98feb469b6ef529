# Two commands: `make demo` and `make test`. Each creates .venv if missing and installs from the lock.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS := dev,examples,tensorboard,mlflow,keras,flax,lightning,numpyro,blackjax,plot,docs,sweep,ray,text
STAMP := $(VENV)/.installed

.PHONY: demo demo-code test lint bench install clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements.lock -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

DEMO_RUN := runs/demo-$(shell date +%Y%m%d-%H%M%S)

demo: $(STAMP)
	$(VENV)/bin/pipekit-train run examples/digits/pretrain_finetune.yaml --run-dir $(DEMO_RUN)
	$(VENV)/bin/pipekit-train run examples/digits/from_scratch.yaml --run-dir $(DEMO_RUN)-scratch
	$(PY) examples/digits/compare.py $(DEMO_RUN) $(DEMO_RUN)-scratch --seeds 3

# The code demo (docs/sequences.md): pretrain a byte-level LM on CPython's stdlib, then full finetuning, LoRA and
# the classifier from scratch over 3 seeds, with a verdict. About 20 minutes on two shared CPU cores.
demo-code: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) examples/code/compare.py $(DEMO_RUN)-code --seeds 3

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadgroup

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache runs

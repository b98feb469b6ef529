"""docs/bayesian.md's MCMC stage is a file that loads from the repository root as written: its data path exists
there, and its `task:` (a sampler kernel in YAML, which docs/yaml.md allows) loads and round-trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pipekit

ROOT = Path(__file__).resolve().parents[2]


def test_the_mcmc_stage_of_the_page_loads_from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "docs" / "bayesian.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S) if "numpyro-mcmc" in b)
    monkeypatch.chdir(ROOT)
    loop = pipekit.loads("pipekit: 1\n" + block)
    assert (ROOT / loop.dataset.source.path).is_file(), loop.dataset.source.path
    assert type(loop.task).__name__ == "NUTS" and pipekit.loads(pipekit.dumps(loop)) == loop
    assert loop.dataset.num_records() == 8

"""The documentation site builds with ``mkdocs build --strict``: every page of docs/, the API reference from the
docstrings, and no link to a missing page or anchor (mkdocs.yml's ``validation`` makes those warnings, which
``--strict`` turns into a failed build)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")

pytestmark = pytest.mark.xdist_group("docs-site")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strict_with_every_page_and_the_api_reference(tmp_path: Path) -> None:
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        built = tmp_path / "site" / ("index.html" if page == Path("index") else page / "index.html")
        assert built.is_file(), f"docs/{page}.md is not in the site"
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("pipekit.Operator", "pipekit_train.TrainingLoop", "pipekit_train.data.TrainingDataset",
                 "pipekit_train.callbacks.EarlyStopping", "pipekit_train.checkpoint.Checkpointer",
                 "pipekit_train.provenance.ArtifactStore", "pipekit_train.inference.export_model",
                 "pipekit_train.adapters.keras.KerasModel", "pipekit_train.adapters.keras.register_keras_model",
                 "pipekit_train.adapters.lightning.TorchModel", "pipekit_train.adapters.lightning.register_torch_model",
                 "pipekit_train.adapters.numpyro.NumpyroModel",
                 "pipekit_train.adapters.numpyro.register_numpyro_model",
                 "pipekit_train.adapters.equinox.register_model"):  # fmt: skip
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
    assert "Train `model_op` on `dataset`" in api or "Train <code>model_op</code> on <code>dataset</code>" in api


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The same validation settings, on a two-page site: a missing page and a missing anchor each fail it."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    for link, complaint in [("other.md#a-section", None), ("missing.md", "missing.md"), ("other.md#nope", "#nope")]:
        (docs / "index.md").write_text(f"# Home\n\nSee [there]({link}).\n")
        out = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        if complaint is None:
            assert out.returncode == 0, out.stdout + out.stderr
        else:
            assert out.returncode != 0 and complaint in out.stderr, out.stdout + out.stderr

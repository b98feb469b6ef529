"""The documentation site builds with ``mkdocs build --strict``: every page of docs/, the API reference from the
docstrings, and no link to a missing page or anchor (mkdocs.yml's ``validation`` makes those warnings, which
``--strict`` turns into a failed build)."""

from __future__ import annotations

import os
import re
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
    # The navigation in the learning order, and terminal output marked for wrapping (tests/docs/test_code_width.py).
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    links = re.findall(r'class="md-nav__link[^"]*"[^>]*href="([^"]*)"|href="([^"]*)"[^>]*class="md-nav__link', home)
    order = [p[:-3] for p in READING_ORDER[1:]]
    seen = [next(n for n in order if h.rstrip("/").endswith(n)) for a, b in links if (h := a or b) and
            any(h.rstrip("/").endswith(n) for n in order)]  # fmt: skip
    assert list(dict.fromkeys(seen)) == order, seen
    assert 'href="stylesheets/extra.css"' in home
    checkpoints = (tmp_path / "site" / "checkpoints" / "index.html").read_text(encoding="utf-8")
    assert 'class="language-text highlight"' in checkpoints


#: The order a reader learns in: start, the pipeline and its parts, what a run keeps, then backends and scale, then
#: the reference. Each page of docs/ is in it once (a page left out fails the strict build).
READING_ORDER = [
    "index.md",
    "quickstart.md",
    "yaml.md",
    "datasets.md",
    "callbacks.md",
    "checkpoints.md",
    "provenance.md",
    "metrics.md",
    "recipes.md",
    "sweeps.md",
    "sequences.md",
    "backends.md",
    "bayesian.md",
    "scale.md",
    "performance.md",
    "reliability.md",
    "api.md",
]


def _nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_the_navigation_reads_in_learning_order() -> None:
    """Not alphabetical ("API reference", "Backends", ... with Quickstart in the middle): the order above."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert _nav_pages(config["nav"]) == READING_ORDER
    assert sorted(READING_ORDER) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The same validation settings, on a two-page site: a missing page and a missing anchor each fail it."""
    import yaml

    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config = yaml.safe_dump({k: v for k, v in settings.items() if k not in ("nav", "extra_css")})  # two pages
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

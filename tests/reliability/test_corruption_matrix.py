"""Corruption of every kind of file a run writes, in-process: detected with the file named, or recovered bitwise.

One small run is trained once (two committed checkpoints, steps 3 and 6; a registered model; an artifact store;
``metrics.jsonl``). Each case copies it, damages one file in one way -- truncated, one bit flipped, deleted,
garbage, valid JSON of the wrong shape, or replaced by the same file of another step -- and then does what a user
would do with that file: resume the run, restore or average its checkpoints, load its model, read its artifact
record or its metrics. The outcome must be one of

* ``detected``: an error of pipekit's own kinds, one line, naming the damaged file (or its checkpoint step);
* ``recovered``: the operation succeeds with exactly what the undamaged run gives (final weights' hash, restored
  arrays, the averaged tree, the record, the metrics).

Anything else (a raw exception, a multi-line message, a message that does not say where, or success with other
data) fails the case. The files are sampled: every kind of file, each with the damages that mean something for
it, about a second per case. ``docs/reliability.md`` gives the counts.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit import PipekitError

#: One xdist worker (``--dist loadgroup``): each layout's undamaged run (`trained`) is trained once for the module.
pytestmark = pytest.mark.xdist_group("corruption-matrix")

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
loss: {type: MSE}
optimizer_config: {name: adam, lr: 1e-2}
max_steps: 6
batch_size: 8
log_every_n_steps: 2
progress: false
callbacks:
- {type: Checkpoint, every_n_steps: 3, async_save: false, keep: [{type: Last, n: 2}], layout: LAYOUT}
"""
CKPT = "run/fit/checkpoints"


def _pipeline(root: Path) -> Any:
    import pipekit
    import pipekit_train  # noqa: F401  (registers the operators)

    return pipekit.loads((root / "pipe.yaml").read_text())


def _flat(tree: Any) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """``trained(layout)``: the undamaged run with checkpoints in that layout, and what reading it gives (the
    reference for ``recovered``); each layout is trained once, on first use."""
    runs: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(layout: str) -> tuple[Path, dict[str, Any]]:
        if layout not in runs:
            runs[layout] = _train(tmp_path_factory.mktemp(f"corruption-{layout}"), layout)
        return runs[layout]

    return get


def _train(root: Path, layout: str) -> tuple[Path, dict[str, Any]]:
    from pipekit_train import Checkpointer, average_checkpoints, run_settings
    from pipekit_train.provenance import ArtifactStore
    from pipekit_train.tracking._history import history

    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (root / "pipe.yaml").write_text(PIPELINE.replace("data.npz", str(root / "data.npz")).replace("LAYOUT", layout))
    with run_settings(run_dir=str(root / "run"), store=str(root / "store.sqlite")):
        _, artifact = _pipeline(root).run()
    assert Checkpointer(root / CKPT).steps() == [3, 6]
    (root / "run" / ".lock").unlink(missing_ok=True)
    with ArtifactStore(str(root / "store.sqlite")) as store:
        record = store.get(artifact.artifact_id).to_dict()
    reference = {
        "hash": artifact.trained_model_hash,
        "artifact_id": artifact.artifact_id,
        "restore": _flat(Checkpointer(root / CKPT).restore("latest")[0]),
        "average": _flat(average_checkpoints(root / CKPT, [3, 6])),
        "record": record,
        "history": history(str(root / "run")),
    }
    return root, reference


# Damage ----------------------------------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00\xffnot what was written\x9c" * 8)


def _wrong_shape(path: Path) -> None:
    path.write_text('{"valid": ["JSON", "of the wrong shape"]}\n')


def _other_step(path: Path) -> None:
    """The same file of the step-3 checkpoint put in step 6's place (a botched copy or sync)."""
    parts = list(path.parts)
    at = len(parts) - 1 - parts[::-1].index("6")
    parts[at] = "3"
    source = Path(*parts)
    if not source.exists():  # content-addressed file names differ between steps: take the largest of its folder
        source = max((p for p in source.parent.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    shutil.copyfile(source, path)


def _flip_field(field: str, where: str) -> Callable[[Path], None]:
    """One bit flipped on purpose in a JSON file's `field`: in its name (``where="key"``) or in the middle of its
    value, so the same byte is hit in every run whatever the file's content (a model hash, an artifact id)."""

    def damage(path: Path) -> None:
        text = path.read_text()
        key_at = text.index(f'"{field}":')
        if where == "key":
            at = key_at + 1
        else:
            value_at = key_at + len(field) + 4  # past '"field": '
            at = value_at + len(json.dumps(json.loads(text)[field])) // 2
        data = bytearray(text.encode())
        data[at] ^= 0x10
        path.write_bytes(bytes(data))

    return damage


def _edit_field(field: str) -> Callable[[Path], None]:
    """`field` changed to another plausible, valid value (valid JSON, the right type): only a digest notices."""

    def damage(path: Path) -> None:
        data = json.loads(path.read_text())
        value = data[field]
        if isinstance(value, int):
            data[field] = value - 1 if value else 1
        else:
            middle = len(value) // 2
            other = "1" if value[middle] == "0" else "0"  # a hex digit for a hex digit
            data[field] = value[:middle] + other + value[middle + 1 :]
        path.write_text(json.dumps(data, indent=2) + "\n")

    return damage


#: final.json's fields, each damaged on purpose (the file's bytes differ per run: a random position would hit a
#: different field each time, and the test would pass or fail by chance).
FINAL_FIELDS = ("model_uri", "step", "epoch", "artifact_id", "digest")

DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncate": _truncate,
    "flip": _flip,
    "delete": Path.unlink,
    "garbage": _garbage,
    "wrong-shape": _wrong_shape,
    "other-step": _other_step,
    **{f"flip-{f}": _flip_field(f, "value") for f in FINAL_FIELDS},
    **{f"flip-key-{f}": _flip_field(f, "key") for f in FINAL_FIELDS},
    **{f"edit-{f}": _edit_field(f) for f in FINAL_FIELDS},
}


# Where the files are ---------------------------------------------------------------------------------------
def _largest(folder: str) -> Callable[[Path], Path]:
    return lambda root: max((p for p in (root / folder).iterdir() if p.is_file()), key=lambda p: p.stat().st_size)


def _registry(name: str) -> Callable[[Path], Path]:
    return lambda root: next((root / "run/models/sha256").iterdir()) / name


def _at(rel: str) -> Callable[[Path], Path]:
    return lambda root: root / rel


# Operations: each returns what it read, compared with the reference ------------------------------------------
def _resume(root: Path) -> Any:
    from pipekit_train import run_settings

    with run_settings(run_dir=str(root / "run"), store=False, resume="auto"):
        _, artifact = _pipeline(root).run()
    return artifact.trained_model_hash


def _resume_from_checkpoint(root: Path) -> Any:
    # The run stopped after its last commit, before recording its end: resume reads the checkpoints.
    for end in ("final.json", "artifact.json"):
        (root / "run/fit" / end).unlink()
    return _resume(root)


def _restore(root: Path) -> Any:
    from pipekit_train import Checkpointer

    return _flat(Checkpointer(root / CKPT).restore("latest")[0])


def _average(root: Path) -> Any:
    from pipekit_train import average_checkpoints

    return _flat(average_checkpoints(root / CKPT, [3, 6]))


def _load_model(root: Path) -> Any:
    from pipekit_train.provenance import load_model

    uri = json.loads((root / "run/fit/final.json").read_text())["model_uri"].split("?")[0]
    return load_model(uri, root / "run/models").weights_hash()


def _show(root: Path) -> Any:
    from pipekit_train.provenance import ArtifactStore

    with ArtifactStore(str(root / "store.sqlite")) as store:
        return store.get(REFERENCE["artifact_id"]).to_dict()


def _history(root: Path) -> Any:
    from pipekit_train.tracking._history import history

    return history(str(root / "run"))


REFERENCE: dict[str, Any] = {}
EXPECTED: dict[Callable[[Path], Any], str] = {
    _resume: "hash",
    _resume_from_checkpoint: "hash",
    _restore: "restore",
    _average: "average",
    _load_model: "hash",
    _show: "record",
    _history: "history",
}

# (file kind, where, damages, operations); checkpoint files in the default (flat) layout, then in the orbax
# layout (several processes). An orbax checkpoint's state is written from NumPy leaves, so it has no `_sharding`
# file and no `array_metadatas` (design/checkpoints.md).
CASES: list[tuple[str, Callable[[Path], Path], tuple[str, ...], tuple[Callable[[Path], Any], ...]]] = [
    ("run.json", _at("run/run.json"), ("truncate", "delete", "garbage", "wrong-shape"), (_resume,)),
    (
        "final.json",
        _at("run/fit/final.json"),
        (
            "garbage",
            "wrong-shape",
            *(f"{how}-{f}" for f in FINAL_FIELDS for how in ("flip", "flip-key", "edit")),
        ),
        (_resume,),
    ),
    ("artifact.json", _at("run/fit/artifact.json"), ("truncate", "delete", "wrong-shape"), (_resume,)),
    ("metrics.jsonl", _at("run/fit/metrics.jsonl"), ("garbage", "delete"), (_resume, _history)),
    ("manifest.json", _at(f"{CKPT}/manifest.json"), ("truncate", "delete", "wrong-shape"), (_resume_from_checkpoint,)),
    ("meta.json", _at(f"{CKPT}/6/meta.json"), ("flip", "other-step", "delete"), (_restore, _resume_from_checkpoint)),
    ("data_iter.json", _at(f"{CKPT}/6/data_iter.json"), ("garbage", "delete", "other-step"), (_restore,)),
    ("commit_success.txt", _at(f"{CKPT}/6/commit_success.txt"), ("delete",), (_resume_from_checkpoint,)),
    ("state.bin", _at(f"{CKPT}/6/state.bin"), ("flip", "truncate", "other-step", "delete"), (_restore, _average)),
    ("weights.npz", _registry("weights.npz"), ("flip", "truncate"), (_load_model, _resume)),
    ("registry meta.json", _registry("meta.json"), ("wrong-shape",), (_load_model,)),
    ("architecture.yaml", _registry("architecture.yaml"), ("garbage",), (_load_model,)),
    ("store.sqlite", _at("store.sqlite"), ("truncate", "garbage"), (_show,)),
]
ORBAX_CASES: list[tuple[str, Callable[[Path], Path], tuple[str, ...], tuple[Callable[[Path], Any], ...]]] = [
    ("meta/metadata", _at(f"{CKPT}/6/meta/metadata"), ("flip", "other-step"), (_restore, _resume_from_checkpoint)),
    ("data_iter/metadata", _at(f"{CKPT}/6/data_iter/metadata"), ("garbage", "delete"), (_restore,)),
    ("_CHECKPOINT_METADATA", _at(f"{CKPT}/6/_CHECKPOINT_METADATA"), ("delete",), (_resume_from_checkpoint,)),
    ("state/_METADATA", _at(f"{CKPT}/6/state/_METADATA"), ("truncate", "other-step"), (_average, _restore)),
    ("state/manifest.ocdbt", _at(f"{CKPT}/6/state/manifest.ocdbt"), ("flip", "other-step"), (_average,)),
    ("array data", _largest(f"{CKPT}/6/state/d"), ("flip", "truncate", "other-step"), (_restore, _average)),
]
PARAMS = [
    pytest.param(layout, kind, where, damage, op, id=f"{prefix}{kind}-{damage}-{op.__name__.lstrip('_')}")
    for layout, prefix, cases in (("flat", "", CASES), ("orbax", "orbax-", ORBAX_CASES))
    for kind, where, damages, ops in cases
    for damage in damages
    for op in ops
]


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
        return len(got) == len(want) and all(
            a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(got, want)
        )
    return bool(got == want)


@pytest.mark.parametrize(("layout", "kind", "where", "damage", "op"), PARAMS)
def test_damage_is_detected_with_the_file_named_or_recovered_bitwise(
    trained: Callable[[str], tuple[Path, dict[str, Any]]],
    tmp_path: Path,
    layout: str,
    kind: str,
    where: Callable[[Path], Path],
    damage: str,
    op: Callable[[Path], Any],
):
    source, reference = trained(layout)
    REFERENCE.update(reference)
    root = tmp_path / "copy"
    shutil.copytree(source, root)
    path = where(root)
    if kind == "store.sqlite":
        with sqlite3.connect(path) as conn:  # everything in the main file, so damaging it damages the records
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    DAMAGE[damage](path)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = op(root)
    except PipekitError as e:
        message = str(e)
        assert "\n" not in message.strip(), f"{type(e).__name__} over several lines:\n{message}"
        names = (str(path), str(path.relative_to(root)), path.name, f"{CKPT}/6", "step 6")
        assert any(n in message for n in names), f"{type(e).__name__} does not name {path}: {message}"
        outcome = f"detected ({type(e).__name__})"
    else:
        assert _same(got, reference[EXPECTED[op]]), f"{op.__name__} succeeded with other data: a silent failure"
        outcome = "recovered" + (f" (warned: {str(said[0].message)[:80]})" if said else "")
    print(f"OUTCOME {kind} {damage} {op.__name__.lstrip('_')}: {outcome}")


@pytest.mark.parametrize(
    ("layout", "rel"), [("flat", "state.bin"), ("orbax", "state/manifest.ocdbt"), ("orbax", "state/_METADATA")]
)
def test_average_over_damaged_array_metadata_is_one_line_naming_the_file_and_what_to_do(
    trained: Callable[[str], tuple[Path, dict[str, Any]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    layout: str,
    rel: str,
):
    from pipekit_train.cli._main import main

    source, _ = trained(layout)
    root = tmp_path / "copy"
    shutil.copytree(source, root)
    path = root / CKPT / "6" / rel
    _garbage(path)
    code = main(["average", str(root / CKPT), "--steps", "3,6", "-o", str(tmp_path / "avg")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert str(path) in err[0] and "use another step" in err[0] and "Traceback" not in err[0], err[0]
    assert not (tmp_path / "avg").exists()

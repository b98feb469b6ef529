"""``pipekit-train average`` and ``pipekit-train runs``: averaging a real run's checkpoints, listing runs, errors."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit_train import (
    MSE,
    Best,
    Checkpoint,
    Checkpointer,
    EquinoxModel,
    Last,
    NpzSource,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.cli._checkpoints import add_checkpoint_commands, main

pytestmark = pytest.mark.xdist_group("cli-checkpoints")  # one worker: the module fixture is built once


def _cli(*argv: str) -> int:
    """Run a command through a parser of our own, as `pipekit-train`'s parser will hold these commands."""
    parser = argparse.ArgumentParser(prog="pipekit-train")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_checkpoint_commands(sub)
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def _flat(tree: Any) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(parts)] = np.asarray(leaf)
    return out


def _loop(root: Path, **overrides: Any) -> TrainingLoop:
    fields: dict[str, Any] = {
        "model_op": EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        "dataset": TrainingDataset(source=NpzSource(path=str(root / "train.npz"))),
        "val_dataset": TrainingDataset(source=NpzSource(path=str(root / "val.npz")), shuffle=False),
        "loss": MSE(),
        "optimizer_config": {"name": "adam", "lr": 0.01},
        "max_steps": 30,
        "batch_size": 8,
        "eval_every_n_steps": 5,
        "log_every_n_steps": 5,
        "progress": False,
        "name": "fit",
        "callbacks": (Checkpoint(every_n_steps=5, keep=(Best(k=2), Last(n=3)), async_save=False),),
    }
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real 30-step run saving every 5 steps, keeping the best 2 by validation loss and the last 3."""
    root = tmp_path_factory.mktemp("cli-checkpoints")
    rng = np.random.default_rng(1)
    for name, n in (("train", 48), ("val", 16)):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        np.savez(root / f"{name}.npz", x=x, y=x.sum(axis=1, keepdims=True))
    with run_settings(run_dir=str(root / "runs" / "exp1"), store=False):
        _loop(root).run()
    ckdir = root / "runs" / "exp1" / "fit" / "checkpoints"
    entries = Checkpointer(ckdir).manifest()
    return {"root": root, "runs": root / "runs", "run_dir": root / "runs" / "exp1", "ckdir": ckdir, "entries": entries}


def test_average_last_3_writes_a_checkpoint_that_restores_to_the_mean_and_records_its_sources(
    trained, tmp_path, capsys
):
    out = tmp_path / "avg"
    steps = [e.step for e in trained["entries"]][-3:]
    assert steps == [20, 25, 30]
    assert _cli("average", str(trained["run_dir"]), "--last", "3", "-o", str(out)) == 0
    printed = capsys.readouterr().out
    assert f"averaged 3 checkpoint(s) of {trained['ckdir']} (steps 20, 25, 30)" in printed
    assert f"wrote {out} (step 30)" in printed and f"init_from: {out}" in printed

    reader = Checkpointer(out)
    assert reader.steps() == [30]
    state, data_iter, meta = reader.restore("latest")
    assert meta["averaged_from"] == steps and meta["source"] == str(trained["ckdir"].absolute())
    assert meta["weight"] == "uniform" and meta["stage"] == "fit" and data_iter == {}
    sources = [_flat(Checkpointer(trained["ckdir"]).restore(s)[0]) for s in steps]
    averaged = _flat(state)
    assert averaged.keys() == sources[0].keys()
    for path, value in averaged.items():
        if np.issubdtype(value.dtype, np.floating):
            mean = (sum(np.asarray(src[path], np.float64) for src in sources) / 3).astype(value.dtype)
            np.testing.assert_array_equal(value, mean, err_msg=path)
        else:  # step counters come from the newest checkpoint
            np.testing.assert_array_equal(value, sources[-1][path], err_msg=path)

    # The average is a starting point: a new stage starts from it with init_from (a learning rate too small to
    # move float32 weights keeps them as loaded).
    loop = _loop(
        trained["root"],
        init_from=str(out),
        max_steps=2,
        val_dataset=None,
        callbacks=(),
        optimizer_config={"name": "sgd", "lr": 1e-30},
    )
    with run_settings(run_dir=str(tmp_path / "warm"), store=False):
        model, _ = loop.run()
    started = {p.removeprefix("params/"): v for p, v in averaged.items() if p.startswith("params/")}
    ended = _flat(eqx.filter(model.module, eqx.is_array))
    assert ended.keys() == started.keys()
    for path, value in started.items():
        np.testing.assert_allclose(ended[path], value, rtol=1e-6, err_msg=path)


def test_average_best_k_and_explicit_steps(trained, tmp_path, capsys):
    scored = sorted((e for e in trained["entries"] if e.score is not None), key=lambda e: (e.score, e.step))
    best = sorted(e.step for e in scored[:2])
    assert _cli("average", str(trained["run_dir"] / "fit"), "--best", "2", "-o", str(tmp_path / "best")) == 0
    assert Checkpointer(tmp_path / "best").restore("latest")[2]["averaged_from"] == best
    assert _cli("average", str(trained["ckdir"]), "--steps", "25, 30", "-o", str(tmp_path / "some")) == 0
    assert Checkpointer(tmp_path / "some").restore("latest")[2]["averaged_from"] == [25, 30]
    assert "(steps 25, 30)" in capsys.readouterr().out


def test_average_rebuilds_a_deleted_manifest_as_a_resume_does(trained, tmp_path, capsys):
    """Its manifest deleted, a run's checkpoint directory is still found (from the stage or the run directory); the
    manifest is rebuilt from the committed steps with the warning a resume gives, and the average is the same."""
    import shutil
    import warnings

    from pipekit_train import PipekitTrainWarning

    run_dir = tmp_path / "exp1"
    shutil.copytree(trained["run_dir"], run_dir)
    ckdir = run_dir / "fit" / "checkpoints"
    (ckdir / "manifest.json").unlink()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _cli("average", str(run_dir), "--last", "3", "-o", str(tmp_path / "avg")) == 0
    steps = [e.step for e in trained["entries"]]
    assert [str(w.message) for w in seen if issubclass(w.category, PipekitTrainWarning)] == [
        f"{ckdir}: step(s) {steps} were committed but missing from manifest.json (there was no readable manifest.json: "
        "deleted, damaged, or a stop before its first write); the manifest lists them again"
    ]
    assert f"averaged 3 checkpoint(s) of {ckdir} (steps 20, 25, 30)" in capsys.readouterr().out
    rebuilt = Checkpointer(ckdir)  # no warning: the manifest was written again
    assert rebuilt.steps() == [e.step for e in trained["entries"]] and rebuilt.monitor == "validate/loss"
    assert rebuilt.best_step() == Checkpointer(trained["ckdir"]).best_step()
    averaged = _flat(Checkpointer(tmp_path / "avg").restore("latest")[0])
    assert _cli("average", str(trained["ckdir"]), "--last", "3", "-o", str(tmp_path / "ref")) == 0
    reference = _flat(Checkpointer(tmp_path / "ref").restore("latest")[0])
    assert averaged.keys() == reference.keys()
    for path, value in averaged.items():
        np.testing.assert_array_equal(value, reference[path], err_msg=path)


def test_runs_lists_the_run_with_its_best_score(trained, capsys):
    run_id = json.loads((trained["run_dir"] / "run.json").read_text())["run_id"]
    best = min((e for e in trained["entries"] if e.score is not None), key=lambda e: (e.score, e.step))
    assert _cli("runs", str(trained["runs"])) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["RUN", "STAGE", "CKPTS", "LATEST", "BEST"]
    row = next(line for line in table if line.startswith(run_id))
    assert row.split()[:7] == [
        run_id,
        "fit",
        str(len(trained["entries"])),
        "30",
        f"{best.score:.4g}",
        "@",
        str(best.step),
    ]
    assert _cli("runs", str(trained["runs"]), "--json") == 0
    (listed,) = [r for r in json.loads(capsys.readouterr().out) if r["run_id"] == run_id]
    assert listed["stage"] == "fit" and listed["latest_step"] == 30 and listed["best_step"] == best.step
    assert listed["best_score"] == best.score and listed["metric"] == "validate/loss"
    assert listed["directory"] == str(trained["ckdir"])


def test_runs_of_an_empty_directory(tmp_path, capsys):
    assert _cli("runs", str(tmp_path)) == 0
    assert capsys.readouterr().out.strip() == "no checkpointed runs found"
    assert _cli("runs", str(tmp_path), "--json") == 0
    assert json.loads(capsys.readouterr().out) == []


def _two_checkpoint_dirs(root: Path) -> Path:
    import jax.numpy as jnp

    for stage in ("a", "b"):
        with Checkpointer(root / "two" / stage / "checkpoints", keep=(Last(n=2),)) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state={"w": jnp.full(3, float(step))}, data_iter={}, meta={"stage": stage})
    return root / "two"


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["average", "{run}", "-o", "{out}"], 2, r"say what to average with exactly one of --last K, --best K"),
        (["average", "{run}", "--last", "2", "--best", "2", "-o", "{out}"], 2, r"exactly one of --last K"),
        (["average", "{run}", "--last", "3"], 2, r"say where to write the average with -o OUT"),
        (["average", "{run}", "--last", "0", "-o", "{out}"], 2, r"--last must be a positive int, got '0'"),
        (["average", "{run}", "--best", "two", "-o", "{out}"], 2, r"--best must be a positive int, got 'two'"),
        (["average", "{run}", "--steps", "20,x", "-o", "{out}"], 2, r"--steps must be a comma-separated list"),
        (["average", "{tmp}/missing", "--last", "3", "-o", "{out}"], 2, r"missing: no such directory"),
        (["average", "{empty}", "--last", "3", "-o", "{out}"], 2, r"holds no checkpoints \(no committed step"),
        (["average", "{two}", "--last", "2", "-o", "{out}"], 2, r"holds 2 checkpoint directories \(.*a/checkpoints"),
        (["average", "{run}", "--steps", "7,30", "-o", "{out}"], 2, r"step\(s\) \[7\] are not committed .* \[.*30\]"),
        (["average", "{two}/a", "--best", "1", "-o", "{out}"], 2, r"picks no checkpoint in .*a/checkpoints"),
        (["average", "{run}", "--last", "3", "-o", "{full}"], 2, r"already holds checkpoints \[1, 2\]"),
        (["average", "{run}", "--last", "3", "-o", "{run}/fit/checkpoints"], 2, r"out_dir must differ from src_dir"),
        (["runs", "{tmp}/missing"], 2, r"run directory not found: .*missing"),
    ],
    ids=[
        "no-selector",
        "two-selectors",
        "no-out",
        "last-0",
        "best-word",
        "steps-word",
        "missing-dir",
        "no-checkpoints",
        "two-checkpoint-dirs",
        "uncommitted-step",
        "nothing-scored",
        "out-not-empty",
        "out-is-source",
        "runs-missing",
    ],
)
def test_bad_arguments_are_one_line_errors(trained, tmp_path, capsys, argv, code, message):
    two = _two_checkpoint_dirs(tmp_path)
    (tmp_path / "empty").mkdir()
    paths = {
        "run": trained["run_dir"],
        "out": tmp_path / "out",
        "tmp": tmp_path,
        "two": two,
        "full": two / "a" / "checkpoints",
        "empty": tmp_path / "empty",
    }
    argv = [a.format(**paths) for a in argv]
    assert _cli(*argv) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    command = argv[0]
    assert lines[0].startswith(f"pipekit-train {command}: error: ")
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # nothing written on an error


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["average", "--last", "3"]) == 2  # no RUN_OR_CKPT_DIR
    assert main(["bogus"]) == 2
    assert "pipekit-train: error: unknown command 'bogus'" in capsys.readouterr().err


def test_runs_as_a_module_in_a_subprocess(trained):
    out = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli._checkpoints", "runs", str(trained["runs"]), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    assert [r["stage"] for r in json.loads(out.stdout)] == ["fit"]

"""Time to the first finished step and peak memory, as whole processes: a hand-written script, the API, the CLI.

Run alone (``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/startup.py --rounds 5``) or as part of ``make bench``
(`benchmarks/run.py` calls `bench_startup`). Every contender trains the same small MLP (32-64x2-1, AdamW, MSE,
batch 32) on the same ``.npz`` file for one step, in a fresh Python process:

- **hand**: ``import jax, equinox, optax``, load the arrays, build the model and the optimizer, ``jax.jit`` one
  step, run it on the first batch and block on the result.
- **api**: ``TrainingLoop(...).run()`` under ``run_settings(store=False)`` (no artifact store), logging every step.
- **cli**: ``pipekit-train run pipe.yaml --no-store`` on the same configuration as YAML.

The clock starts in this process just before the child is spawned and stops at the first finished step: the hand
script prints its ``time.time()`` after ``block_until_ready``; pipekit's is the ``time`` of the first ``train``
record in the run's ``metrics.jsonl`` (written after the step's loss was read back from the device). Peak memory
is the child's ``VmHWM`` from ``/proc/self/status`` when it exits (the process after its ``exec``; ``ru_maxrss``
would also count the pages of the parent it was forked from, 1 GB inside ``run.py``), written by a small runner
around each contender; CPU seconds are the child's user + system time. The contenders run interleaved, one of
each per round in a rotated order, and the medians are reported. Every process gets the same environment and no
persistent compilation cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IN_SIZE, WIDTH, DEPTH, BATCH, LR = 32, 64, 2, 32, 1e-3

#: What every hand-written script does before it trains: load the arrays, build the model and the optimizer, jit a
#: step (a template: `str.format` fills the sizes).
_HAND_SETUP = textwrap.dedent(
    """
    import time

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    with np.load("data.npz") as npz:
        x, y = npz["x"], npz["y"]
    model = eqx.nn.MLP({in_size}, 1, {width}, {depth}, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw({lr}, weight_decay=1e-4, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
    opt_state = optimizer.init(params)

    def loss_fn(params, xb, yb):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(xb) - yb) ** 2)

    @jax.jit
    def step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    """
)

#: The hand-written script (also the reference of tests/test_startup_cost.py, at its own sizes).
HAND_TEMPLATE = _HAND_SETUP + textwrap.dedent(
    """
    idx = np.random.default_rng(0).permutation(len(x))[:{batch}]
    params, opt_state, loss = step(params, opt_state, x[idx], y[idx])
    jax.block_until_ready((params, loss))
    print("FIRST_STEP", time.time(), float(loss), flush=True)
    """
)
HAND = HAND_TEMPLATE.format(in_size=IN_SIZE, width=WIDTH, depth=DEPTH, lr=LR, batch=BATCH)

#: A 300-step job (`JOB_STEPS`), whole process: the hand script's loop over one shuffled epoch's batches, reading
#: the loss back at the end; against the Python API with its defaults (artifact store, metrics file).
JOB_STEPS = 300
HAND_JOB = (
    _HAND_SETUP
    + textwrap.dedent(
        """
    perm = np.random.default_rng(0).permutation(len(x))
    for i in range({steps}):
        idx = perm[i * {batch} : (i + 1) * {batch}]
        params, opt_state, loss = step(params, opt_state, x[idx], y[idx])
    print("LOSS", float(loss), flush=True)
    """
    )
).format(in_size=IN_SIZE, width=WIDTH, depth=DEPTH, lr=LR, batch=BATCH, steps=JOB_STEPS)

#: The Python API's script: `steps` steps, a log line every `log` steps, under `run_settings(store=...)`.
_API_TEMPLATE = textwrap.dedent(
    """
    from pipekit_train import MSE, EquinoxModel, NpzSource, TrainingDataset, TrainingLoop, run_settings

    loop = TrainingLoop(
        model_op=EquinoxModel(
            factory="mlp", kwargs={{"in_size": {in_size}, "out_size": 1, "width_size": {width}, "depth": {depth}}}
        ),
        dataset=TrainingDataset(source=NpzSource(path="data.npz")),
        loss=MSE(),
        optimizer_config={{"name": "adamw", "lr": {lr}}},
        max_steps={steps},
        batch_size={batch},
        log_every_n_steps={log},
        progress=False,
    )
    with run_settings(store={store}, run_dir="run"):
        loop.run()
    """
)
_FIELDS = dict(in_size=IN_SIZE, width=WIDTH, depth=DEPTH, lr=LR, batch=BATCH)
#: One step, logged, no artifact store (time to first step).
API = _API_TEMPLATE.format(**_FIELDS, steps=1, log=1, store=False)
#: The `JOB_STEPS` job with the defaults: the artifact store (a file in the work folder), a log line every 100 steps.
API_JOB = _API_TEMPLATE.format(**_FIELDS, steps=JOB_STEPS, log=100, store='"store.db"')

YAML = textwrap.dedent(
    """\
    pipekit: 1
    type: TrainingLoop
    model_op:
      type: EquinoxModel
      factory: mlp
      kwargs: {{in_size: {in_size}, out_size: 1, width_size: {width}, depth: {depth}}}
    dataset:
      type: TrainingDataset
      source: {{type: NpzSource, path: data.npz}}
    loss: {{type: MSE}}
    optimizer_config: {{name: adamw, lr: {lr}}}
    max_steps: 1
    batch_size: {batch}
    log_every_n_steps: 1
    progress: false
    """
).format(in_size=IN_SIZE, width=WIDTH, depth=DEPTH, lr=LR, batch=BATCH)


RUNNER = textwrap.dedent(
    """
    import atexit, runpy, sys

    PEAK_FILE = sys.argv[1]  # sys.argv is replaced below, before the exit hook runs

    def peak_rss():
        with open("/proc/self/status") as status:
            kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
        with open(PEAK_FILE, "w") as out:
            out.write(kb)

    atexit.register(peak_rss)
    if sys.argv[2] == "-m":
        sys.argv = sys.argv[3:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


@dataclass
class Sample:
    first_step_s: float
    process_s: float
    cpu_s: float
    peak_rss_mb: float


@dataclass
class Contender:
    name: str
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None

    def median(self, attr: str) -> float | None:
        values = [getattr(s, attr) for s in self.samples]
        return statistics.median(values) if values else None


def _first_train_time(metrics: Path) -> float:
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "metrics" and record.get("context") == "train":
            return float(record["time"])
    raise RuntimeError(f"{metrics}: no train record (did the run fail?)")


def run_one(name: str, work: Path) -> Sample:
    """One fresh process of contender `name` in `work` (which holds data.npz and the scripts)."""
    run_dir = work / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    (work / "store.db").unlink(missing_ok=True)
    hwm = work / f"peak-{name}.txt"
    hwm.unlink(missing_ok=True)
    argv = [sys.executable, "runner.py", str(hwm)]
    if name in ("hand", "api", "hand_job", "api_job"):
        argv += [f"{name}.py"]
    else:
        argv += ["-m", "pipekit_train.cli", "run", "pipe.yaml", "--run-dir", "run", "--no-store"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_PLATFORMS"] = "cpu"
    start = time.time()
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    ended = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}: {err.strip().splitlines()[-1:] or out}")
    if name == "hand":
        line = next(ln for ln in out.splitlines() if ln.startswith("FIRST_STEP"))
        first = float(line.split()[1])
    elif name.endswith("_job"):  # whole processes only
        first = ended
    else:
        first = _first_train_time(next(run_dir.rglob("metrics.jsonl")))
    return Sample(
        first_step_s=first - start,
        process_s=ended - start,
        cpu_s=usage.ru_utime + usage.ru_stime,
        # ru_maxrss would count the pages of the (large) parent the child was forked from: no fallback to it.
        peak_rss_mb=int(hwm.read_text()) / 1024 if hwm.exists() else float("nan"),  # kB
    )


def prepare(work: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16_384, IN_SIZE)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((IN_SIZE, 1)).astype(np.float32)).astype(np.float32)
    np.savez(work / "data.npz", x=x, y=y)
    (work / "hand.py").write_text(HAND)
    (work / "api.py").write_text(API)
    (work / "hand_job.py").write_text(HAND_JOB)
    (work / "api_job.py").write_text(API_JOB)
    (work / "pipe.yaml").write_text(YAML)
    (work / "runner.py").write_text(RUNNER)


def measure(rounds: int, names: tuple[str, ...] = ("hand", "api", "cli")) -> dict[str, Contender]:
    """`rounds` interleaved rounds of the contenders `names` (``hand``, ``api``, ``cli``: one step; ``hand_job``,
    ``api_job``: the `JOB_STEPS` job), after one untimed warm-up process each."""
    contenders = {n: Contender(n) for n in names}
    with tempfile.TemporaryDirectory(prefix="pipekit-first-step-") as tmp:
        work = Path(tmp)
        prepare(work)
        for c in contenders.values():  # warm the page cache (site-packages, .pyc files) for everyone alike
            try:
                run_one(c.name, work)
            except Exception as e:
                c.error = f"{type(e).__name__}: {e}"
        live = [c for c in contenders.values() if c.error is None]
        for r in range(rounds):
            k = r % max(len(live), 1)
            for c in live[k:] + live[:k]:
                try:
                    c.samples.append(run_one(c.name, work))
                except Exception as e:
                    c.error = f"{type(e).__name__}: {e}"
    return contenders


def paired_minus_hand(contenders: dict[str, Contender], name: str) -> float | None:
    """Median over rounds of (`name`'s first step - the hand script's in the same round), in seconds.

    What the target is about (hand + 0.5 s); pairing by round takes out most of a loaded machine's drift.
    """
    hand, c = contenders["hand_job" if name.endswith("_job") else "hand"], contenders[name]
    if hand.error or c.error or not c.samples:
        return None
    diffs = [s.first_step_s - h.first_step_s for s, h in zip(c.samples, hand.samples, strict=False)]
    return statistics.median(diffs) if diffs else None


def report(contenders: dict[str, Contender]) -> str:
    lines = [
        "| process | first step (s) | minus hand, paired (s) | whole process (s) | CPU (s) | peak RSS (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in contenders.values():
        if c.error:
            lines.append(f"| {c.name} | error: {c.error} | | | | |")
            continue
        cells = [f"{c.median(a):.2f}" for a in ("first_step_s", "process_s", "cpu_s")]
        diff = paired_minus_hand(contenders, c.name) if c.name not in ("hand", "hand_job") else None
        cells.insert(1, "" if diff is None else f"{diff:+.2f}")
        lines.append(f"| {c.name} | " + " | ".join(cells) + f" | {c.median('peak_rss_mb'):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--job", action="store_true", help=f"the {JOB_STEPS}-step job, whole processes, instead")
    args = parser.parse_args(argv)
    contenders = measure(args.rounds, ("hand_job", "api_job") if args.job else ("hand", "api", "cli"))
    print(report(contenders))
    result: dict[str, Any] = {
        c.name: {"error": c.error, "samples": [s.__dict__ for s in c.samples]} for c in contenders.values()
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

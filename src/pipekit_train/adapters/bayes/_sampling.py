"""The chunked sampler stage every sampler backend (``numpyro-mcmc``, ``blackjax``) builds on: the checks before
sampling, the initial point handed over by a previous stage (`init_strategy`), the `StepBackend` base
(`SamplerControls`: ``until``, the progress line, the end-of-stage posterior report) and the cache of compiled
sampler programs."""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipekit import ConfigError, PipekitError
from pipekit_train.backends import StepBackend

from ._data import check_data, check_sites, data_origin, full_data
from ._kernels import UNTIL_DEFAULT_CHECK_EVERY, UNTIL_DEFAULT_CHECK_GROWTH, _Kernel
from ._model_ops import NumpyroGuide, NumpyroModel


def check_after(n: int, every: int, growth: float) -> int:
    """The `until` check after the one at sampling iteration `n` (0: the warm-up's end): `every` iterations later,
    or, once the draws so far are many, `growth` times them rounded up to a multiple of `every`. A check reads
    every draw so far, so checks spaced in proportion to the draws cost a bounded fraction of sampling; a fixed
    spacing would make their total grow with the square of the draws. `growth` 0 checks every `every`."""
    return n + every * max(1, math.ceil(growth * n / every))


@dataclass
class SamplerSetup:
    """A checked sampler stage: the model operator, the kernel, the data, and an initial point (or ``None``)."""

    model_op: Any
    kernel: _Kernel
    data: dict[str, np.ndarray]
    num_samples: int
    kept: int
    init_values: dict[str, np.ndarray] | None
    init_source: str | None


def prepare(
    loop: Any, incoming: Any, stage: str, kernels: tuple[type[_Kernel], ...], *, check: bool = True
) -> SamplerSetup:
    """The sampler stage's setup; with `check` (pre-flight), every check it can make before compiling, each a
    one-line `ConfigError`. `start` prepares again without them: they ran once, in pre-flight."""
    model_op = loop.model_op
    kernel = loop.task
    if check:
        _check(loop, stage, kernels)
    num_samples = kernel.samples_for(loop.max_steps)
    kept = kernel.kept(loop.max_steps)
    data = full_data(loop.dataset)
    if check:
        check_data(model_op, data, stage, data_origin(loop.dataset))
        check_sites(model_op, data, stage)
        _note_batch_size(loop, stage)
    init_values, source = _initial_point(model_op, incoming, data, stage, loop.backend)
    return SamplerSetup(model_op, kernel, data, num_samples, kept, init_values, source)


#: `TrainingLoop.batch_size`'s default: a sampler stage that sets another value is told it is unused.
_DEFAULT_BATCH_SIZE = 32


def _note_batch_size(loop: Any, stage: str) -> None:
    """One line on stderr when a sampler stage sets `batch_size`: a sampler takes the data whole, so it is unused
    (a note, not an error: files written before samplers ignored it keep running)."""
    import sys

    if loop.batch_size != _DEFAULT_BATCH_SIZE:
        print(
            f"note: stage {stage!r}: batch_size ({loop.batch_size}) is unused: a sampler takes the data whole; "
            "remove it",
            file=sys.stderr,
            flush=True,
        )


def _check(loop: Any, stage: str, kernels: tuple[type[_Kernel], ...]) -> None:
    kernel = loop.task
    names = "/".join(k.__name__ for k in kernels)
    if not isinstance(kernel, kernels):
        raise ConfigError(
            f"stage {stage!r} (backend {loop.backend!r}) needs its kernel as `task` ({names}, e.g. "
            f"task: {{type: {kernels[0].__name__}, num_warmup: 500, num_samples: 1000}}), got {kernel!r}"
        )
    if loop.loss is not None:
        raise ConfigError(f"stage {stage!r}: a sampler has no loss; remove loss: {loop.loss!r} (the kernel is `task`)")
    if loop.val_dataset is not None or loop.test_dataset is not None:
        raise ConfigError(
            f"stage {stage!r}: a sampler stage does not evaluate val/test datasets; evaluate the posterior after "
            "the run (load_model(uri).predictive(...))"
        )
    if loop.init_from:
        raise ConfigError(f"stage {stage!r}: init_from warm-starts optimizers; a sampler starts from its init_strategy")
    if loop.transfer is not None:
        raise ConfigError(f"stage {stage!r}: a sampler stage takes no `transfer`; it starts from the whole model")
    if kernel.until is not None:
        _check_until(loop, stage)


def _check_until(loop: Any, stage: str) -> None:
    """What `until` needs of the stage (its own keys and values were checked when the kernel was built)."""
    kernel = loop.task
    name = type(kernel).__name__
    where = f"stage {stage!r}: {name}.until"
    until = kernel.until
    every = until.get("check_every", UNTIL_DEFAULT_CHECK_EVERY)
    if "r_hat_max" in until and kernel.num_chains < 2:
        raise ConfigError(
            f"{where}.r_hat_max needs num_chains >= 2 (split R-hat compares chains; ArviZ gives NaN for one chain), "
            f"got num_chains: {kernel.num_chains}; set num_chains: 4, or use ess_bulk_min / ess_tail_min alone"
        )
    samples = kernel.samples_for(loop.max_steps)
    if every > samples:
        raise ConfigError(
            f"{where}.check_every ({every}) is more than the draws the stage may take ({samples}, until.max_draws or "
            f"max_steps - num_warmup): it would never check; set check_every <= {samples}"
        )
    spc = loop.steps_per_call
    if spc != "auto" and every % int(spc) != 0:
        lower = max(int(spc), every // int(spc) * int(spc))
        raise ConfigError(
            f"{where}.check_every ({every}) must be a multiple of steps_per_call ({spc}): checks run between chunks; "
            f"set check_every: {lower} (or {lower + int(spc)}), or steps_per_call to a divisor of {every}"
        )


def init_strategy(kernel: Any, init_values: dict[str, Any] | None) -> Any:
    """NumPyro's ``init_to_*`` strategy of `kernel` (its ``init_strategy``), or ``init_to_value`` of `init_values`
    (the initial point a previous stage handed over) when given."""
    import jax.numpy as jnp
    import numpyro.infer as infer

    if init_values is not None:
        return infer.init_to_value(values={k: jnp.asarray(v) for k, v in init_values.items()})
    return {
        "uniform": infer.init_to_uniform,
        "median": infer.init_to_median,
        "sample": infer.init_to_sample,
        "feasible": infer.init_to_feasible,
        "mean": infer.init_to_mean,
    }[kernel.init_strategy]


def _initial_point(
    model_op: Any, incoming: Any, data: dict[str, Any], stage: str, backend: str
) -> tuple[dict[str, np.ndarray] | None, str | None]:
    previous = getattr(incoming, "model", None)
    if previous is None:
        return None, None
    if not isinstance(previous, (NumpyroModel, NumpyroGuide)) or previous.model != model_op.model:
        raise ConfigError(
            f"stage {stage!r} (backend {backend!r}) samples model {model_op.model!r} but the previous stage produced "
            f"{previous!r}; a sampler can only start from a guide or posterior of the same NumPyro model"
        )
    if previous.module is None:
        return None, None
    if isinstance(previous, NumpyroGuide):
        if not previous.params:  # pre-flight: the previous stage has not trained yet
            return None, "median of the previous stage's guide"
        return previous.median(data), f"median of {previous.guide} ({getattr(incoming, 'artifact_id', None)})"
    draws = previous.posterior.flat()
    if not draws:
        return None, None
    return {k: np.median(v, axis=0) for k, v in draws.items()}, "posterior median of the previous stage"


def config_digest(*parts: Any) -> np.ndarray:
    """A checkpoint leaf that pins the sampler configuration (``task`` is not in the core's fingerprint)."""
    import pipekit

    parts = tuple(p.sampler_settings() if isinstance(p, _Kernel) else p for p in parts)
    text = "\n".join(pipekit.dumps(p, strict=False) if p is not None else "null" for p in parts)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8).copy()


def check_digest(saved: Any, expected: np.ndarray, stage: str) -> None:
    from pipekit import ConfigError

    if not np.array_equal(np.asarray(saved), expected):
        raise ConfigError(
            f"refusing to resume stage {stage!r}: the sampler kernel (task) changed since the checkpoint was written; "
            "resume with the original kernel or start a new run"
        )


class SamplerControls(StepBackend):
    """What the two samplers' step backends share: the engine's loop (a `batch_size` above the data capped: a
    sampler takes no batches), the run's summary for the artifact, the posterior report, and the `StepBackend`
    methods that have no meaning for a sampler."""

    loop: Any
    setup: SamplerSetup

    def engine_loop(self, loop: Any) -> Any:
        return engine_loop(loop, loop.dataset.num_records())

    def summary(self) -> dict[str, Any]:
        k = self.setup.kernel
        out = {
            "kernel": type(k).__name__,
            "num_chains": k.num_chains,
            "num_warmup": k.num_warmup,
            "num_samples": self.setup.num_samples,
            "draws_per_chain": self.filled(),  # type: ignore[attr-defined]
            "init": self.setup.init_source or k.init_strategy,
        }
        if k.until is not None:
            self.until_reached(self.step)  # type: ignore[attr-defined]  # the last step's values, if not checked
            self._complete_until_record()
            out["until"] = {
                "config": dict(k.until),
                **self._until_record,
                "checks": self._until_checks,  # in this process (a resumed run counts its own)
                "check_s": self._until_check_s,
            }
        return out

    # The progress line --------------------------------------------------------------------------------------
    _chain_divergences: np.ndarray | None = None
    _chain_stats: dict[str, np.ndarray] | None = None

    def chain_stats(self) -> dict[str, np.ndarray] | None:
        """Each chain's latest sampler statistics for the progress line, ``(chains,)`` by label (``step size``,
        ``accept``: the mean acceptance rate of the phase so far, ``tree depth`` for NUTS), or ``None`` while the
        latest chunk runs. Default: none."""
        return {}

    def progress_chains(self, step: int) -> str | None:
        """The progress line's part of a sampler: the chains' phase (warm-up or sampling, with its iteration;
        vectorized chains move in lockstep), each chain's divergences after warm-up so far and its latest step
        size, acceptance rate and tree depth (`chain_stats`). Values are read from the device only once the latest
        chunk has finished (``is_ready``), so drawing the line never makes the host wait; until then the line shows
        the previous ones."""
        k = self.setup.kernel
        latest = self.chain_divergences()  # type: ignore[attr-defined]
        if latest is not None:
            self._chain_divergences = latest
        if self._chain_divergences is None:
            self._chain_divergences = np.zeros(k.num_chains, np.int64)
        stats = self.chain_stats()
        if stats is not None:
            self._chain_stats = stats
        if step < k.num_warmup:
            phase = f"warm-up {step}/{k.num_warmup}"
        else:
            phase = f"sampling {step - k.num_warmup}/{self.setup.num_samples}"
        chains = f"chains 0-{k.num_chains - 1}" if k.num_chains > 1 else "chain 0"
        divs = " ".join(str(int(d)) for d in self._chain_divergences)
        parts = [f"{chains} {phase}", f"divergences [{divs}]"]
        for label, values in (self._chain_stats or {}).items():
            fmt = "{:d}" if values.dtype.kind in "iu" else "{:.3g}"
            parts.append(f"{label} [{' '.join(fmt.format(v.item()) for v in values)}]")
        return " | ".join(parts)

    # `until`: sample until converged (the engine asks at every chunk end; see docs/bayesian.md) -------------
    _until_at: int = -1
    _until_done: bool = False
    _until_record: dict[str, Any] = {}
    _until_checks: int = 0
    _until_check_s: float = 0.0

    @property
    def check_every(self) -> int:
        until = self.setup.kernel.until or {}
        return int(until.get("check_every", UNTIL_DEFAULT_CHECK_EVERY))

    @property
    def check_growth(self) -> float:
        until = self.setup.kernel.until or {}
        return float(until.get("check_growth", UNTIL_DEFAULT_CHECK_GROWTH))

    def chunk_periods(self) -> list[int]:
        """Periods the engine's chunks must not cross: with `until`, the warm-up's end (the checks come from
        `next_boundary`)."""
        k = self.setup.kernel
        return [k.num_warmup] if k.until is not None and k.num_warmup else []

    def next_boundary(self, step: int) -> int:
        """The next check after `step` (`check_after`, counted from the warm-up's end), or the stage's end."""
        k = self.setup.kernel
        total = k.num_warmup + self.setup.num_samples
        if k.until is None or step < k.num_warmup:
            return total if k.until is None else k.num_warmup
        n = step - k.num_warmup
        check = 0
        while check <= n:
            check = check_after(check, self.check_every, self.check_growth)
        return min(total, k.num_warmup + check)

    def until_reached(self, step: int) -> bool:
        """Whether the stage has converged at `step`, a check point (`next_boundary`, and the last step): the
        diagnostics of the draws so far (`_diagnostics.diagnostics`, as ArviZ computes them) meet every criterion.
        A pure function of the draws, so a resumed run decides as the uninterrupted one did."""
        k = self.setup.kernel
        until = k.until
        if until is None:
            return False
        if step == self._until_at:
            return self._until_done
        n = step - k.num_warmup
        last = step >= k.num_warmup + self.setup.num_samples
        if n <= 0 or not (last or self.next_boundary(step - 1) == step):
            return False
        from ._diagnostics import evaluate, load_scipy

        load_scipy()  # its first import is not a check's cost
        draws = self.draws()  # type: ignore[attr-defined]  # waits for the chunk: sampling time, not the check's
        t0 = time.perf_counter()
        met, values = evaluate(draws, until)  # the criteria, up to the first that fails
        self._until_check_s += time.perf_counter() - t0
        self._until_checks += 1
        self._until_at, self._until_done = step, met
        if met or last:
            self._until_record = {
                "stopped": "converged" if met else "max_draws",
                "iterations": n,
                "draws": self.filled(),  # type: ignore[attr-defined]
                "step": step,
                **values,
            }
        return self._until_done

    def _complete_until_record(self) -> None:
        """The values at the stop that its check did not compute (those of criteria not given, or after the first
        that failed): the posterior report's, computed on the same draws when the stage completed (the same
        numbers: every column's diagnostics are its own), else computed here."""
        record = self._until_record
        missing = [name for name in ("r_hat_max", "ess_bulk_min", "ess_tail_min") if record and name not in record]
        if not missing:
            return
        reported = self._posterior_metrics or {}
        if all(f"posterior/{name}" in reported for name in missing):
            record.update({name: reported[f"posterior/{name}"] for name in missing})
        else:
            from ._diagnostics import diagnostics

            values = diagnostics(self.draws())  # type: ignore[attr-defined]
            record.update({name: values[name] for name in missing})

    _posterior_metrics: dict[str, float] | None = None

    def final_metrics(self, stage: str, stage_dir: str) -> dict[str, float]:
        """The posterior's diagnostics (printed and written beside the stage's metrics) when sampling completed."""
        import sys

        from ._posterior import report, write_groups
        from ._predictive import stage_groups
        from ._registry import get_numpyro_model

        draws = self.draws()  # type: ignore[attr-defined]
        if stage_dir:
            op, kernel = self.setup.model_op, self.setup.kernel
            observed = get_numpyro_model(op.model).observed
            kwargs = op.model_kwargs(self.setup.data)
            groups, notes = stage_groups(op.fn, kwargs, draws, kernel, observed, self.loop.seed)
            for note in notes:
                print(f"note: stage {stage!r}: {note}", file=sys.stderr, flush=True)
            write_groups(stage_dir, {"sample_stats": self.sample_stats(), **groups})  # type: ignore[attr-defined]
        self._posterior_metrics = report(draws, self.divergences(), stage, stage_dir)  # type: ignore[attr-defined]
        return self._posterior_metrics

    def extend_from(self, restore: Any, previous: Any) -> None:
        """Continue a finished stage of `previous` (its `TrainingLoop`) from its final checkpoint, read as saved:
        the sampler state as it is, the draws so far at the front of this longer stage's buffer
        (`pipekit_train.stage.extend`). The kernel must be `previous`'s but for ``num_samples``."""
        tree = restore(None)
        check_digest(tree["config"], config_digest(previous.task, self.setup.model_op), self.loop.name or "stage")
        draws = {}
        for name, leaf in self.draws_tree().items():  # type: ignore[attr-defined]
            saved = np.asarray(tree["draws"][name])
            grown = np.zeros(leaf.shape, saved.dtype)
            grown[: saved.shape[0]] = saved  # (draws, ...) first: the new draws go after them
            draws[name] = grown
        self.load_state_tree({**tree, "draws": draws, "config": self.digest})  # type: ignore[attr-defined]

    def get_lr_scale(self) -> float:
        return 1.0

    def set_lr_scale(self, value: float) -> None:
        raise PipekitError("a sampler has no learning rate to scale (ReduceLROnPlateau does not apply)")

    def learning_rate(self, step: int) -> float:
        return 0.0

    def evaluate(self, batch: Any) -> dict[str, Any]:
        raise PipekitError("a sampler stage does not evaluate batches")

    def set_model(self, model_op: Any) -> None:
        raise PipekitError("a sampler's posterior is its draws; it cannot be replaced by a callback")


def precision() -> str:
    """The floating-point precision the sampler runs in: ``float64`` when JAX's 64-bit mode is on (set
    ``JAX_ENABLE_X64=1`` before the run: NumPyro's ``enable_x64()`` and Stan sample in double precision), else
    ``float32``. Recorded in the artifact's ``backend_info["precision"]``."""
    import jax

    return "float64" if jax.dtypes.canonicalize_dtype(np.float64) == np.float64 else "float32"


def engine_loop(loop: Any, n: int) -> Any:
    """The loop the engine drives: batches are not used by a sampler, so a batch_size above the data is capped."""
    return loop if loop.batch_size <= n else loop.replace(batch_size=n)


#: Sampler programs (jitted chunks and what they close over) seen in this process, by `program_key`: runs of the
#: same model, data and kernel (a resumed run, a repeated stage, a test's reference run) trace and compile once.
_PROGRAMS: OrderedDict[str, Any] = OrderedDict()
_MAX_PROGRAMS = 4


def program_key(backend: str, setup: SamplerSetup) -> str:
    """A digest of everything a sampler's traced program depends on: the backend, model operator (with its
    kwargs), kernel, sizes, data and initial point. The seed is not part of it (it only changes the state)."""
    import pipekit

    h = hashlib.sha256(backend.encode())
    h.update(pipekit.dumps(setup.model_op, strict=False).encode())
    h.update(pipekit.dumps(setup.kernel.sampler_settings(), strict=False).encode())
    h.update(f"{setup.num_samples}/{setup.kept}".encode())
    kwargs = setup.model_op.kwargs
    h.update(repr(sorted((k, v) for k, v in kwargs.items() if isinstance(v, str))).encode())
    arrays = {k: v for k, v in kwargs.items() if not isinstance(v, str)}
    for values in (setup.data, setup.init_values or {}, arrays):
        for name in sorted(values):
            arr = np.ascontiguousarray(values[name])
            h.update(f"{name}:{arr.dtype}:{arr.shape}".encode())
            h.update(arr.tobytes())
    return h.hexdigest()


def cached_program(key: str, build: Callable[[], Any]) -> Any:
    """The program cached under `key`, or `build()`'s (kept for the next runs; the least recently used goes)."""
    program = _PROGRAMS.pop(key, None)
    if program is None:
        program = build()
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return program

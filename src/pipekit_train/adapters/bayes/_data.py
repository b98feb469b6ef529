"""The checks every Bayesian stage runs before compiling: data against the model's parameters and sites."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipekit import ConfigError, suggestion
from pipekit_train.data import DataFile, NpzSource

from ._registry import get_numpyro_model


def full_data(dataset: Any) -> dict[str, Any]:
    """The whole dataset as one batch (transforms applied), in record order. A `DataFile` (one record of named
    values) gives each value as in the file: the record axis dropped, an integer scalar as a Python ``int`` (Stan's
    sizes, such as ``J``, can then size a plate or an array as the model's arguments)."""
    n = dataset.num_records()
    batch = dict(next(iter(dataset.epoch_batches(n))))
    if not isinstance(dataset.source, DataFile):
        return batch
    return values_of({key: np.asarray(value)[0] for key, value in batch.items()})


def values_of(values: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A `DataFile`'s values as a model's arguments: integer scalars as Python ``int`` (they may size a plate)."""
    return {k: int(v) if v.ndim == 0 and v.dtype.kind in "iu" else v for k, v in values.items()}


def check_names(model_op: Any, data: Mapping[str, Any], where: str, origin: str) -> None:
    """A one-line error for a name of `data` that is not a parameter of the model: `origin` (the file), the name,
    its shape, the model's parameters and the closest one."""
    spec = get_numpyro_model(model_op.model)
    for key in data:
        if key not in spec.parameters:
            shape = tuple(np.shape(data[key]))
            raise ConfigError(
                f"{where}: {origin} has {key!r} (shape {shape}), which is not a parameter of model {spec.name!r}"
                f"{suggestion(key, spec.parameters)}; the model takes: {', '.join(spec.parameters)} (drop the name "
                "from the file, or select names with keys: [...])"
            )


def data_origin(dataset: Any) -> str:
    """Where a stage's data comes from, for errors: ``DataFile 'path'`` for a file source, else ``the dataset``."""
    source = dataset.source
    if isinstance(source, (DataFile, NpzSource)):
        return f"{type(source).__name__} {source.path!r}"
    return "the dataset"


def check_data(model_op: Any, data: Mapping[str, Any], stage: str, origin: str = "the dataset") -> None:
    """One-line errors for data the model cannot use: unknown keys, missing observations, NaN or inf values.
    `origin` names where the data come from (`data_origin`)."""
    spec = get_numpyro_model(model_op.model)
    where = f"stage {stage!r} ({model_op!r})"
    check_names(model_op, data, where, origin)
    for key in data:
        if key in model_op.kwargs:
            raise ConfigError(f"{where}: {key!r} is given both by the dataset and by kwargs; keep one")
    for name in spec.observed:
        if name not in data:
            raise ConfigError(
                f"{where}: the observed site {name!r} has no data; the dataset has keys {sorted(data)}"
                f"{suggestion(name, list(data))} (rename the key, e.g. with a Rename transform)"
            )
    given = set(data) | set(model_op.kwargs)
    missing = [p for p in spec.required if p not in given]
    if missing:
        raise ConfigError(
            f"{where}: model {spec.name!r} needs {', '.join(repr(m) for m in missing)}, which neither the dataset "
            f"(keys {sorted(data)}) nor kwargs give"
        )
    for key, value in data.items():
        arr = np.asarray(value)
        if arr.dtype.kind == "f":
            bad: np.ndarray | list[int] = (
                np.flatnonzero(~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)) if arr.ndim else []
            )
            if arr.ndim == 0 and not np.isfinite(arr):
                bad = [0]
            if len(bad):
                raise ConfigError(
                    f"{where}: the data {key!r} holds NaN or inf in {len(bad)} record(s), first at record "
                    f"{int(bad[0])}; drop or impute them before sampling"
                )


def check_sites(model_op: Any, data: Mapping[str, Any], stage: str) -> dict[str, dict[str, Any]]:
    """Trace the model once on `data`: every observed parameter feeds an observed site. Returns each site's
    ``type``, ``is_observed`` and whether it is ``discrete``, by name."""
    spec = get_numpyro_model(model_op.model)
    where = f"stage {stage!r} ({model_op!r})"
    try:
        trace = _site_kinds(spec.fn, model_op.model_kwargs(data))
    except Exception as e:  # the model itself failed on this data
        raise ConfigError(f"{where}: the model failed on the stage's data: {describe_error(e)}") from None
    observed = [n for n, s in trace.items() if s["type"] == "sample" and s.get("is_observed")]
    if not observed:
        raise ConfigError(
            f"{where}: the model has no observed site on this data (dataset keys {sorted(data)}); its likelihood "
            "gets no data, so the posterior would be the prior"
        )
    for name in spec.observed:
        site = trace.get(name)
        if site is not None and site["type"] == "sample" and not site.get("is_observed"):
            raise ConfigError(f"{where}: the site {name!r} has no data (it was sampled, not observed)")
    discrete = [n for n, s in trace.items() if s["type"] == "sample" and not s.get("is_observed") and s["discrete"]]
    if discrete:
        raise ConfigError(
            f"{where}: the latent site(s) {discrete} are discrete; enumerate them out in the model "
            "(gradient-based samplers and guides need continuous latents)"
        )
    return trace


def _site_kinds(fn: Any, kwargs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What the checks read of the model's trace (each site's type, whether observed, whether discrete).

    The model is traced as NumPyro's own initialisation traces it: seeded, with every latent site's value
    substituted by ``init_to_uniform`` (a distribution without ``sample``, such as ``ImproperUniform``, is never
    sampled). It is traced abstractly (`jax.eval_shape`: nothing is computed or compiled; run eagerly, every
    distribution's sampling and log-density is a small program XLA compiles on the stage's first run, about half a
    second for eight schools). A model that needs concrete values (Python control flow on an array) cannot be traced
    so and is run eagerly, as before; a model that fails eagerly too raises that error.
    """
    import jax
    from numpyro import handlers
    from numpyro.infer import init_to_uniform

    arrays = {k: v for k, v in kwargs.items() if isinstance(v, (np.ndarray, jax.Array))}
    rest = {k: v for k, v in kwargs.items() if k not in arrays}
    kinds: dict[str, dict[str, Any]] = {}

    def trace(arrays: Mapping[str, Any]) -> None:
        kinds.clear()
        with handlers.block():
            seeded = handlers.substitute(handlers.seed(fn, jax.random.PRNGKey(0)), substitute_fn=init_to_uniform)
            sites = handlers.trace(seeded).get_trace(**arrays, **rest)
        for name, site in sites.items():
            sample = site["type"] == "sample"
            kinds[name] = {
                "type": site["type"],
                "is_observed": bool(site.get("is_observed")),
                "discrete": bool(sample and site["fn"].support.is_discrete),
            }

    trace_abstract_first(trace, arrays)
    return kinds


def trace_abstract_first(fn: Any, *args: Any) -> None:
    """Run `fn(*args)`, a function that records a NumPyro trace, under `jax.eval_shape` (the sites' names and shapes:
    nothing is computed or compiled); one that needs concrete values (Python control flow on a drawn value or an
    array) is run eagerly instead, as it would run without this, and an error there is the caller's to report."""
    import jax

    try:
        jax.eval_shape(fn, *args)
    except Exception:
        fn(*args)


def describe_error(e: BaseException) -> str:
    """``Type: first line of the message``; for an exception without a message (NumPyro raises a bare
    ``NotImplementedError`` from a distribution without ``sample``), ``Type raised at file:line in function``, the
    innermost frame of its traceback (a path inside an installed package shown from the package's name, one under
    the working directory relative to it)."""
    import traceback

    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text.splitlines()[0]}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return f"{type(e).__name__} (no message)"
    last = frames[-1]
    path = last.filename
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        cwd = os.getcwd() + os.sep
        path = path[len(cwd) :] if path.startswith(cwd) else path
    return f"{type(e).__name__} (no message) raised at {path}:{last.lineno} in {last.name}"

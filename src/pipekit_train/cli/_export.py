"""The ``pipekit-train export`` command: a trained model's inference function as a ``jax.export`` file, or
(``--format arviz``) a sampler's posterior as an ArviZ netCDF file.

``export ARTIFACT_ID|MODEL_URI -o model.jaxexport [--batch N | --symbolic-batch] [--store PATH]`` writes the
serialized function (weights included) and ``model.jaxexport.json``, its provenance. The input shape comes from
the artifact's training dataset; a model URI that no artifact in the store produced needs ``--input-shape`` (and
``--dtype``, default float32). Exit codes: 0 done, 2 a mistake in what was asked (one line on standard error),
1 a failure.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ._common import EXIT_OK, UsageError, guarded, run_commands

__all__ = ["add_export_commands", "main"]


def parse_shape(values: Sequence[str]) -> list[int]:
    """``["28", "28", "1"]`` or ``["28,28,1"]`` → ``[28, 28, 1]``: one example's shape."""
    parts = [p.strip() for v in values for p in v.split(",") if p.strip()]
    if not parts or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise UsageError(
            f"--input-shape must be positive ints, e.g. --input-shape 64 or 28,28,1; got {' '.join(values)}"
        )
    return [int(p) for p in parts]


def _import_user_modules(args: argparse.Namespace) -> None:
    """The modules the artifact's run imported (its models, datasets), then $PIPEKIT_IMPORT and --import."""
    from ._imports import import_modules, requested_imports

    requests: list[tuple[str, str]] = []
    if not args.source.startswith("pipekit-model:"):
        from ..provenance._store import ArtifactStore

        store = ArtifactStore(args.store)
        if store.path.exists():
            artifact = store.get(args.source)
            requests += [
                (r["module"], f"artifact {artifact.artifact_id[:12]} recorded import") for r in artifact.imports
            ]
    import_modules([*requests, *requested_imports(args.imports)])


def cmd_export_format(args: argparse.Namespace) -> int:
    """Write the model in one of its own formats (`ModelOp.export_formats`): ``arviz``, a sampler's posterior."""
    given = [
        f
        for f, v in (
            ("--batch", args.batch),
            ("--input-shape", args.input_shape),
            ("--dtype", args.dtype),
            ("--platform", args.platform),
            ("--symbolic-batch", args.symbolic_batch or None),
        )
        if v is not None
    ]
    if given:
        raise UsageError(
            f"--format {args.format} writes the model's own file; {', '.join(given)} belong to --format jaxexport"
        )
    _import_user_modules(args)

    from ..inference._formats import export_file

    written = export_file(args.source, args.output, args.format, store=args.store)
    print(f"wrote {written['path']} ({written['origin']}; {written['summary']})")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Serialize the model's inference function with jax.export, and write its provenance next to it."""
    if args.format != "jaxexport":
        return cmd_export_format(args)
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch must be a positive int, got {args.batch}")
    if args.dtype is not None and args.input_shape is None:
        raise UsageError("--dtype goes with --input-shape (one example's shape, e.g. --input-shape 64)")
    shape = parse_shape(args.input_shape) if args.input_shape is not None else None
    _import_user_modules(args)

    from ..inference._export import export_model, sidecar_path

    record: dict[str, Any] = export_model(
        args.source,
        args.output,
        batch=args.batch,
        symbolic_batch=args.symbolic_batch,
        input_shape=shape,
        dtype=args.dtype,
        platforms=args.platform,
        store=args.store,
    )
    inputs = record["input"]
    outputs = ", ".join(f"{o['dtype']}{o['shape']}" for o in record["outputs"])
    origin = f"artifact {record['artifact_id'][:12]}" if record["artifact_id"] else record["model_uri"].split("?")[0]
    print(
        f"wrote {args.output} ({origin}; {inputs['dtype']}{inputs['shape']} -> {outputs}; "
        f"{', '.join(record['platforms'])})"
    )
    print(f"wrote {sidecar_path(args.output)} (provenance: weights {record['weights_hash']})")
    return EXIT_OK


def add_export_commands(sub: Any) -> None:
    """Add ``export`` to the subparsers `sub` of ``pipekit-train``'s parser."""
    p = sub.add_parser(
        "export",
        help="serialize a trained model's inference function with jax.export",
        description=(
            "Write a trained model's inference function, weights included, as a jax.export file that a process "
            "with only JAX can load (jax.export.deserialize), and its provenance as FILE.json."
        ),
    )
    p.add_argument("source", metavar="ARTIFACT_ID|MODEL_URI", help="an artifact id (or unique prefix) or a model URI")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write (e.g. model.jaxexport)")
    p.add_argument(
        "--format",
        default="jaxexport",
        metavar="FORMAT",
        help="jaxexport (default): the inference function; or a format of the model's own (ModelOp.export_formats), "
        "e.g. arviz: a sampler's posterior, sample_stats and observed_data as ArviZ netCDF (-o post.nc)",
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, metavar="N", help="a fixed batch size (default: the training batch size)")
    batch.add_argument("--symbolic-batch", action="store_true", help="accept any batch size (a symbolic dimension)")
    p.add_argument(
        "--input-shape",
        nargs="+",
        metavar="DIM",
        help="one example's input shape (e.g. 64, or 28 28 1); needed for a model URI without an artifact",
    )
    p.add_argument("--dtype", metavar="DTYPE", help="the input dtype with --input-shape (default float32)")
    p.add_argument(
        "--platform",
        action="append",
        metavar="NAME",
        help="lower for this platform: cpu, cuda, rocm, tpu (repeatable; default: JAX's default backend here)",
    )
    p.add_argument("--store", metavar="PATH", help="artifact store (default $PIPEKIT_ARTIFACT_STORE or runs/)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first, for the models it registers (repeatable; the artifact's recorded imports too)",
    )
    p.set_defaults(func=guarded("export", cmd_export))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``export`` with `argv` (the `pipekit-train` command line holds it too)."""
    return run_commands(add_export_commands, argv, description="Export a trained model with jax.export.")

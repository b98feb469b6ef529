"""Print the demo's comparison: pretrained-then-finetuned classifier vs the same classifier from scratch.

Usage: python examples/digits/compare.py RUN_DIR SCRATCH_RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _final(run_dir: Path, stage: str) -> dict:
    path = run_dir / stage / "artifact.json"
    if not path.exists():
        sys.exit(f"compare.py: {path} not found; run the demo pipelines first (make demo)")
    return json.loads(path.read_text())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    finetuned = _final(Path(argv[0]), "finetune")
    scratch = _final(Path(argv[1]), "scratch")
    print("\nDigits, 10% of the training labels: does unsupervised pretraining help?")
    print(f"{'classifier':<34} {'val acc':>8} {'test acc':>9}")
    for label, art in (("pretrained encoder + finetune", finetuned), ("from scratch", scratch)):
        m = art["final_metrics"]
        print(f"{label:<34} {100 * m['validate/accuracy']:>7.1f}% {100 * m['test/accuracy']:>8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

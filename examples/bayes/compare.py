"""Held-out accuracy of the NUTS posterior predictive beside a plain (L2) logistic regression."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression

from pipekit_train import load_model

HERE = Path(__file__).parent


def main(run_dir: str) -> None:
    train, test = np.load(HERE / "cancer_train.npz"), np.load(HERE / "cancer_test.npz")
    final = json.loads((Path(run_dir) / "nuts" / "final.json").read_text())
    uri = final["model_uri"]
    root = uri.split("root=", 1)[1] if "root=" in uri else None
    if root and not root.startswith("/"):
        uri = uri.split("?", 1)[0] + "?root=" + str((Path(run_dir) / root).absolute())
    posterior = load_model(uri)
    p = posterior({"x": test["x"]})  # posterior-predictive probability of y = 1
    bayes = float(np.mean((p > 0.5) == test["y"]))
    plain = LogisticRegression(max_iter=2000).fit(train["x"], train["y"]).score(test["x"], test["y"])
    print(f"held-out accuracy: NUTS posterior predictive {bayes:.3f}, plain logistic regression {plain:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/cancer")

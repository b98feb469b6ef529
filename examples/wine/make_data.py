"""Write scikit-learn's wine data as two CSV files with class names, and score LogisticRegression on them.

``wine_train.csv`` (133 rows) and ``wine_test.csv`` (45 rows) are a stratified split of
`sklearn.datasets.load_wine` (seed 0). Like scikit-learn's own CSVs, each starts with a count line (rows, features,
class names) before the header (``skip_rows: 1`` in wine.yaml); then an ``id`` column, the 13 measurements and
``target``, the class name (``class_0``, ``class_1``, ``class_2``). The baseline is scikit-learn's
`LogisticRegression` on standardized features, fitted on the training file and scored on the test file: the number
``pipekit-train evaluate ... --data examples/wine/wine_test.csv`` should match within 2 points.

    python examples/wine/make_data.py             # writes the two files (the same bytes every time)
    python examples/wine/make_data.py --baseline  # and prints LogisticRegression's test accuracy
"""

from __future__ import annotations

import csv
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def write(folder: str = HERE) -> tuple[str, str]:
    """Write ``wine_train.csv`` and ``wine_test.csv`` into `folder`; return their paths."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    wine = load_wine()
    ids = np.arange(len(wine.target))
    train, test = train_test_split(ids, test_size=45, stratify=wine.target, random_state=0)
    names = [n.replace("/", "_") for n in wine.feature_names]  # od280/od315_of_diluted_wines
    paths = []
    for split, rows in (("train", np.sort(train)), ("test", np.sort(test))):
        path = os.path.join(folder, f"wine_{split}.csv")
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow([len(rows), len(names), *wine.target_names])  # scikit-learn's count line
            writer.writerow(["id", *names, "target"])
            for i in rows:
                values = [f"{v:g}" for v in wine.data[i]]
                writer.writerow([int(i), *values, wine.target_names[wine.target[i]]])
        paths.append(path)
    return paths[0], paths[1]


def read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The features and the class names of one written file."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[2:]
    return np.array([[float(v) for v in r[1:-1]] for r in rows]), np.array([r[-1] for r in rows])


def baseline(train_path: str, test_path: str) -> float:
    """scikit-learn's LogisticRegression (standardized features) fitted on `train_path`, its accuracy on
    `test_path`."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = read(train_path)
    x_test, y_test = read(test_path)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)
    return float(model.score(x_test, y_test))


if __name__ == "__main__":
    train_csv, test_csv = write()
    if "--baseline" in sys.argv[1:]:
        print(f"LogisticRegression test accuracy: {baseline(train_csv, test_csv):.4f}")

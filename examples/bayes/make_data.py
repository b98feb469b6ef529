"""Write the example data: eight schools, and scikit-learn's breast cancer split into train/test (standardised)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def main() -> None:
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], np.float32)
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], np.float32)
    np.savez(HERE / "eight_schools.npz", y=y, sigma=sigma)

    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, t = load_breast_cancer(return_X_y=True)
    x_tr, x_te, t_tr, t_te = train_test_split(x, t, test_size=0.25, random_state=0, stratify=t)
    mean, sd = x_tr.mean(0), x_tr.std(0)
    for name, xs, ts in (("train", x_tr, t_tr), ("test", x_te, t_te)):
        np.savez(HERE / f"cancer_{name}.npz", x=((xs - mean) / sd).astype(np.float32), y=ts.astype(np.float32))


if __name__ == "__main__":
    main()

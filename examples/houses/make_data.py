"""Write ``houses.csv``: 360 made-up house sales in two cities, from a fixed seed (the committed file is its output).

City A (240 sales) is the larger market the model pretrains on; city B (120 sales) prices the same features
differently, and is what the second stage finetunes on. Each row is assigned to ``train``, ``val`` or ``test``.

    python examples/houses/make_data.py     # rewrites examples/houses/houses.csv, byte for byte the same
"""

from __future__ import annotations

import csv
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(seed: int = 2026) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    out = []
    for city, n, base, per_m2, per_room, age_cost in (
        ("A", 240, 80.0, 3.1, 12.0, 0.9),
        ("B", 120, 150.0, 4.4, 6.0, 1.6),
    ):
        area = rng.uniform(35, 180, n).round(0)
        rooms = np.clip((area / 30 + rng.normal(0, 0.7, n)).round(0), 1, 7)
        age = rng.uniform(0, 90, n).round(0)
        noise = rng.normal(0, 12.0, n)
        price = (base + per_m2 * area + per_room * rooms - age_cost * age + noise).round(1)  # thousands
        split = rng.choice(["train", "val", "test"], size=n, p=[0.7, 0.1, 0.2])
        for i in range(n):
            out.append([city, split[i], f"{area[i]:.0f}", f"{rooms[i]:.0f}", f"{age[i]:.0f}", f"{price[i]:.1f}"])
    return out


def main() -> None:
    with open(os.path.join(HERE, "houses.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["city", "split", "area_m2", "rooms", "age_years", "price_k"])
        writer.writerows(rows())


if __name__ == "__main__":
    main()

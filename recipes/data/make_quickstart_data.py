"""Write recipes/data/quickstart.jsonl: a small synthetic prompt/completion task for the quickstart.

    python recipes/data/make_quickstart_data.py            # rewrites quickstart.jsonl next to this file
    python recipes/data/make_quickstart_data.py --out x.jsonl --rows 3000 --seed 0

Three kinds of rows, mixed, each with a completion a tiny byte-level model can learn from the prompt:
  kind of apple =      ->  fruit     (word -> one of 6 categories; a fixed table)
  add 12+34 =          ->  46        (two-digit addition)
  upper cat =          ->  CAT       (upper-case a short word; copy with a fixed byte offset)
Standard library only; the same seed always writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CATEGORIES = {
    "fruit": "apple banana cherry grape lemon mango melon peach pear plum",
    "animal": "cat dog horse mouse tiger zebra sheep goat wolf bear",
    "color": "red blue green yellow purple orange pink brown black white",
    "tool": "hammer saw drill wrench chisel shovel rake axe pliers file",
    "vehicle": "car bus truck train boat plane bike tram van ship",
    "body": "hand foot head knee elbow nose ear eye mouth arm",
}
WORDS = sorted({w for words in CATEGORIES.values() for w in words.split()})
CATEGORY_OF = {w: cat for cat, words in CATEGORIES.items() for w in words.split()}
# Share of each kind of row; lookups dominate because they are learned first and fastest.
MIX = (("kind", 0.5), ("add", 0.3), ("upper", 0.2))


def make_row(kind: str, rng: random.Random) -> dict:
    if kind == "kind":
        word = rng.choice(WORDS)
        return {"prompt": f"kind of {word} =", "completion": f" {CATEGORY_OF[word]}"}
    if kind == "add":
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        return {"prompt": f"add {a}+{b} =", "completion": f" {a + b}"}
    word = rng.choice(WORDS)
    return {"prompt": f"upper {word} =", "completion": f" {word.upper()}"}


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX, strict=True)
    return [make_row(rng.choices(kinds, weights)[0], rng) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("quickstart.jsonl"))
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = make_rows(args.rows, args.seed)
    with args.out.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows ({args.out.stat().st_size / 1024:.0f} KB) to {args.out}")


if __name__ == "__main__":
    main()

"""Writes examples/data/chat_arithmetic.parquet, a small verl-style chat dataset.

    python examples/make_chat_parquet.py [OUT.parquet] [--rows N]

Columns as verl's data preprocessing writes them: `prompt` (a list of {role, content}
messages), `reward_model: {style, ground_truth}`, `data_source`, `ability`,
`extra_info: {split, index}`. examples/chat_parquet.yaml trains on it as it is.
The prompts are bare sums ("12+345=") so the tiny character model the example builds can
read them; a real dataset would hold questions in words.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DEFAULT = Path(__file__).parent / "data" / "chat_arithmetic.parquet"


def rows(count: int, seed: int = 0) -> list[dict]:
    """`count` verl-style rows of 2-digit additions."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({
            "data_source": "peerflow/chat-arithmetic",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": index},
        })
    return out


def write(path: Path, count: int) -> Path:
    """Writes the parquet file (via Hugging Face `datasets`) and returns its path."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows(count)).to_parquet(str(path))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT))
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    print(write(Path(args.out), args.rows))

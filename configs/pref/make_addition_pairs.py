"""Write the README's preference job: pairs of answers to the RL job's addition problems.

    python configs/pref/make_addition_pairs.py [--prompts configs/rl/addition.jsonl] [--seed 0]

Each record ``{"prompt": "381+571=", "answer": "8530"}`` of the RL job's prompts (written by
``configs/rl/make_addition.py``: every number least significant digit first) becomes a pair
``{"prompt": ..., "chosen": answer, "rejected": near miss}`` in ``addition_pairs.jsonl`` beside this
script, in the same order, so that ``data.heldout_fraction=0.125`` holds out the same last 256
problems (in neither the SFT text nor the training pairs). The near miss is the answer with every
carry dropped (the SFT data's mistake, `carry_free`) where the problem carries, else the answer with
one digit (drawn by ``--seed``) moved by one. Seeded: the same arguments write the same file.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "rl"))
from make_addition import carry_free  # noqa: E402 - the SFT data's mistake


def near_miss(prompt: str, answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: the carry-free one, or one digit moved by one."""
    wrong = carry_free(prompt)
    if wrong != answer:
        return wrong
    digits = list(answer)
    index = rng.randrange(len(digits) - 1)          # not the last digit (0 without a carry)
    digits[index] = str((int(digits[index]) + rng.choice((1, 9))) % 10)
    return "".join(digits)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=str(HERE.parent / "rl" / "addition.jsonl"))
    parser.add_argument("--out", default=str(HERE / "addition_pairs.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    records = [json.loads(line) for line in pathlib.Path(args.prompts).read_text().splitlines()]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": near_miss(r["prompt"], r["answer"], rng)}
             for r in records]
    pathlib.Path(args.out).write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    print(f"{args.out}: {len(pairs)} pairs")


if __name__ == "__main__":
    main()

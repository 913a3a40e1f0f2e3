"""Write the README's RL task: 3-digit addition with every number written least significant digit first.

    python configs/rl/make_addition.py [--sft-records N] [--rl-records 1792] [--heldout 256] [--digits 3] [--seed 0]

A problem a + b (a, b drawn from [0, 10**digits)) is written with the digits of a, b and the sum
reversed and zero-padded (``digits`` for a and b, ``digits + 1`` for the sum), so the answer can be
produced digit by digit, each from the two digits above it and the carry:

    a = 183, b = 175, sum 358  ->  "381+571=" answer "8530"

Two files beside this script, every (a, b) pair in at most one record of them:

    addition_sft.jsonl  {"text": "381+571=8530"}: the solved examples of ``configs/rl/addition_sft.yaml``
                        (data.kind=text; each line a document, EOS appended)
    addition.jsonl      {"prompt": "381+571=", "answer": "8530"}: the prompts of ``configs/rl/addition.yaml``
                        (data.kind=prompts): ``--rl-records`` training prompts that GRPO samples from,
                        then the ``--heldout`` held-out ones, which are its last
                        ``data.heldout_fraction = heldout / (rl_records + heldout)`` records (0.125)

So the held-out problems are neither in the SFT text nor among GRPO's training prompts. The SFT
demonstrations are imperfect on purpose: a share ``--mistakes`` (0.6) of them drop every carry
(each digit (a_i + b_i) mod 10, the last 0: "381+571=8430"). The SFT model learns both behaviours
and, the carry-free one being the more frequent, greedily drops many carries: it is right on
0.31-0.37 of the held-out problems (17% of them have no carry). Its samples carry often enough that
GRPO with an exact-match reward finds the right answers and makes carrying the greedy behaviour.
Seeded: the same arguments write the same files.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent


def reverse(n: int, width: int) -> str:
    return str(n).zfill(width)[::-1]


def problem(a: int, b: int, digits: int) -> tuple[str, str]:
    """``(prompt, answer)`` of a + b, every number reversed and zero-padded."""
    return f"{reverse(a, digits)}+{reverse(b, digits)}=", reverse(a + b, digits + 1)


def carry_free(prompt: str) -> str:
    """The answer of ``prompt`` with every carry dropped: each digit (a_i + b_i) mod 10, the last 0."""
    a, b = prompt[:-1].split("+")
    return "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b)) + "0"


def problems(count: int, digits: int, seed: int) -> list[tuple[str, str]]:
    """``count`` problems with distinct (a, b) pairs."""
    if count > 10 ** (2 * digits):
        raise SystemExit(f"only {10 ** (2 * digits)} distinct problems with {digits} digits")
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < count:
        pair = (rng.randrange(10 ** digits), rng.randrange(10 ** digits))
        if pair not in seen:
            seen.add(pair)
            out.append(problem(*pair, digits))
    return out


def write_jsonl(path: pathlib.Path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-records", type=int, default=10000)
    parser.add_argument("--rl-records", type=int, default=1792)
    parser.add_argument("--heldout", type=int, default=256)
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--mistakes", type=float, default=0.6,
                        help="share of the SFT examples whose answer drops every carry")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE), help="directory of the two files")
    args = parser.parse_args(argv)
    drawn = problems(args.rl_records + args.heldout + args.sft_records, args.digits, args.seed)
    prompts, sft = drawn[:args.rl_records + args.heldout], drawn[args.rl_records + args.heldout:]
    heldout = prompts[args.rl_records:]
    assert not {p for p, _ in heldout} & {p for p, _ in sft}, "a held-out problem is in the SFT text"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed + 1)
    sft = [(p, carry_free(p) if rng.random() < args.mistakes else a) for p, a in sft]
    write_jsonl(out / "addition_sft.jsonl", ({"text": p + a} for p, a in sft))
    write_jsonl(out / "addition.jsonl", ({"prompt": p, "answer": a} for p, a in prompts))
    print(f"{out / 'addition_sft.jsonl'}: {len(sft)} solved examples; {out / 'addition.jsonl'}: "
          f"{args.rl_records} training + {args.heldout} held-out prompts "
          f"(data.heldout_fraction={args.heldout / len(prompts):g})")


if __name__ == "__main__":
    main()

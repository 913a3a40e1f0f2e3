"""Writes questions.jsonl: 64 held-out questions of the chat task in configs/chat/conversations.jsonl
(a digit 0-3, a space, 5-9 capital letters; the answer is the digit's word), 16 per digit, seed 0,
none equal to a training conversation's user turn.

    python configs/lm_eval/k3_digits/make_questions.py
"""
import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
TRAIN = HERE.parents[1] / "chat" / "conversations.jsonl"
WORDS = ["zero", "one", "two", "three"]


def main() -> None:
    seen = {json.loads(line)["messages"][0]["content"] for line in TRAIN.read_text().splitlines() if line.strip()}
    rng = random.Random(0)
    rows = []
    for index in range(64):
        digit = index % 4
        while True:
            question = f"{digit} " + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(5, 9)))
            if question not in seen:
                break
        seen.add(question)
        rows.append({"question": question, "choices": WORDS, "answer": digit})
    rng.shuffle(rows)
    (HERE / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()

"""A partial-credit reward for configs/rl/addition.yaml (``rl.reward=configs.rl.addition_reward:digits``).

The fraction of the answer's digits that the completion has right, position by position (a completion
of another length loses the missing or extra positions): 1.0 only for the exact answer, so with
``rl.pass_threshold=1.0`` the pass rate (``heldout_pass``) is exact-match accuracy, while the reward
separates the completions of a group that are all wrong, which exact_match scores alike.
"""


def digits(prompt: str, completion: str, record: dict) -> float:
    answer, completion = str(record["answer"]).strip(), completion.strip()
    right = sum(a == c for a, c in zip(answer, completion))
    return right / max(len(answer), len(completion), 1)

"""Rewards for examples/custom_reward.yaml — plain Python, no PeerFlow imports needed.

A reward receives the decoded answer and the example it answers (a dict: `prompt`,
`answer`, `index`, and any other dataset columns) and returns a float, or a dict with a
`score` plus extra metrics. A function whose first parameter is `responses` (or
`completions`) is called once with every answer of a batch instead. Both may be
`async def`. PeerFlow runs them in worker processes with a time and a memory limit
(`task.reward_limits`).
"""


def reversed_digits(response, example):
    """Partial credit: the fraction of the reversed digits in the right place."""
    answer = str(example["answer"])
    guess = response.strip()
    hits = sum(a == b for a, b in zip(guess, answer))
    return {"score": hits / len(answer), "exact": float(guess == answer)}


def right_length(responses, examples):
    """Batched: 1 for an answer as long as the reference, else 0."""
    return [float(len(r.strip()) == len(str(e["answer"]))) for r, e in zip(responses, examples)]

"""A deterministic reward with a learning signal, for the end-to-end trainer tests.

The built-in synthetic reward scores 0 on nearly every response of the untrained tiny model, so
every group-normalised advantage is 0 and every actor update leaves the weights as they were. This
one scores a response by the parity of a hash of its text: samples of one prompt differ, the
advantages are not 0 and the updates change the weights.
"""

import zlib

REWARD_TYPE = "batch"


def compute_score(reward_inputs: list[dict]) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        accuracy = float(zlib.crc32(item["response"].encode("utf-8", "replace")) % 2)
        scores.append({"overall": accuracy, "accuracy": accuracy})
    return scores


def parse_parity(verdict: str, sample: dict) -> float:
    """A judge verdict parser (worker.judge.parser) that reads any verdict: the parity of a hash of the
    verdict and the judged response, so the tiny judge's few verdicts (colour words, not yes or no)
    score 0 and 1 alike, and a change of either changes the score."""
    return float(zlib.crc32((verdict + "\n" + sample["response"]).encode("utf-8", "replace")) % 2)

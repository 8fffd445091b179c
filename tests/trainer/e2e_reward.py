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

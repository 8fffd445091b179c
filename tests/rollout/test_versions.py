"""PolicyVersions: the driver's one holder of the policy's version, its weights and the engines'."""

from __future__ import annotations

import threading

import pytest

from easyvlm.rollout.versions import NOT_SYNCED, PolicyVersions


def test_publish_makes_the_version_current_with_its_weights_and_release_forgets_older_ones():
    versions = PolicyVersions()
    versions.start(3)  # resumed from a step-3 checkpoint
    assert versions.current == 3 and versions.held == NOT_SYNCED
    versions.publish(3, "w3")
    versions.publish(4, "w4")
    assert versions.current == 4
    assert versions.weights() == (4, "w4")  # the newest
    assert versions.weights(3) == (3, "w3")
    versions.release_before(4)
    assert not versions.published(3) and versions.published(4)
    with pytest.raises(KeyError):
        versions.weights(3)
    versions.advance()  # the last step: no weights published for version 5
    assert versions.current == 5 and versions.weights() == (4, "w4")


def test_the_engines_need_weights_until_they_hold_the_version_and_again_after_a_restart():
    versions = PolicyVersions()
    assert versions.engines_need(0)  # the model files' weights, not version 0's
    versions.engines_hold(0)
    assert not versions.engines_need(0) and versions.engines_need(1)
    versions.engines_lost()
    assert versions.held == NOT_SYNCED and versions.engines_need(0)


def test_a_waiter_on_the_lock_wakes_when_a_version_is_published():
    versions = PolicyVersions()
    seen = []

    def wait_for_version_2():
        with versions.cond:
            versions.cond.wait_for(lambda: versions.current >= 2, timeout=30)
            seen.append(versions.weights())

    waiter = threading.Thread(target=wait_for_version_2)
    waiter.start()
    versions.advance()  # 1: not yet
    versions.publish(2, "w2")
    waiter.join(30)
    assert seen == [(2, "w2")]

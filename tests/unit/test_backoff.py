"""`Backoff`: the retry waits shared by the step loop, the delta pump and the journal."""

from __future__ import annotations

import pytest

from controller.backoff import Backoff


def test_waits_double_up_to_the_cap_and_reset_starts_again() -> None:
    backoff = Backoff(0.25, 3.0)
    assert [backoff.next_s() for _ in range(6)] == [0.25, 0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert [backoff.next_s() for _ in range(2)] == [0.25, 0.5]


def test_a_first_wait_above_the_cap_is_kept_once_then_capped() -> None:
    # What the hand-written loops did: the first wait as configured, then min(2 x, max).
    backoff = Backoff(4.0, 1.0)
    assert [backoff.next_s() for _ in range(3)] == [4.0, 1.0, 1.0]


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (0.1, 0.0), (-1.0, 1.0)])
def test_a_wait_that_is_not_positive_is_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Backoff(first_s, max_s)

"""`make serve`'s watchdog: pauses are tolerated, a lasting outage or a controller gone for
good ends the process (exit 1), so a supervisor restarts it. Virtual time."""

from __future__ import annotations

from cluster.serve import Unrecoverable, watch_health


class Script:
    """A ping that follows a script of answers, on a clock that `wait` advances."""

    def __init__(self, answers: list[bool | Exception]) -> None:
        self.answers = answers
        self.now = 0.0
        self.num_pings = 0

    def ping(self) -> bool:
        answer = self.answers[min(self.num_pings, len(self.answers) - 1)]
        self.num_pings += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    def wait(self, seconds: float) -> None:
        self.now += seconds


def test_a_restart_pause_is_tolerated_and_a_lasting_outage_is_not() -> None:
    # Unhealthy for 20 s (a restart), healthy again, then down for good.
    script = Script([True] * 3 + [False] * 10 + [True] * 5 + [False])
    reason = watch_health(script.ping, give_up_after_s=60.0, interval_s=2.0,
                          clock=lambda: script.now, wait=script.wait)
    assert "not healthy for 60s" in reason
    assert script.num_pings == 3 + 10 + 5 + 31  # gave up 60 s into the second outage


def test_a_controller_gone_for_good_ends_at_once() -> None:
    script = Script([True, Unrecoverable("the controller died and will not be restarted")])
    reason = watch_health(script.ping, give_up_after_s=600.0, interval_s=2.0,
                          clock=lambda: script.now, wait=script.wait)
    assert "will not be restarted" in reason and script.num_pings == 2

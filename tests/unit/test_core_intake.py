"""Bad input at the core's intake: a clear ValueError and nothing left behind."""

import pytest

from controller.core import ControllerCore, PoolSpec
from controller.messages import SamplingParams
from controller.scheduler import SchedulerConfig


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "empty"), ([1, 2, 100], r"\[0, 100\)"), ([-1], r"\[0, 100\)")])
def test_bad_prompt_is_refused_without_a_trace(prompt, message):
    core = ControllerCore([PoolSpec(8, 4)], SchedulerConfig(), vocab_size=100)
    with pytest.raises(ValueError, match=message):
        core.add_request(prompt, SamplingParams(max_tokens=2))
    assert not core.request_to_worker and not core.has_unfinished()
    core.add_request([1, 2, 3], SamplingParams(max_tokens=2))  # the next one is served
    assert core.has_unfinished()
    core.check_integrity()

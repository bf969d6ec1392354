"""Bad input at the core's intake: a clear ValueError and nothing left behind."""

import pytest

from controller.core import ControllerCore, ModelFacts, PoolSpec
from controller.messages import SamplingParams
from controller.options import ControllerOptions
from controller.scheduler import SchedulerConfig
from controller.step_loop import StepLoop


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "empty"), ([1, 2, 100], r"\[0, 100\)"), ([-1], r"\[0, 100\)")])
def test_bad_prompt_is_refused_without_a_trace(prompt, message):
    core = ControllerCore([PoolSpec(8, 4)], model=ModelFacts(vocab_size=100))
    with pytest.raises(ValueError, match=message):
        core.add_request(prompt, SamplingParams(max_tokens=2))
    assert not core.request_to_worker and not core.has_unfinished()
    core.add_request([1, 2, 3], SamplingParams(max_tokens=2))  # the next one is served
    assert core.has_unfinished()
    core.check_integrity()


def test_abort_mid_prefill_leaves_no_protection_state():
    from tests.unit.fake_runner import FakeRunner

    core = ControllerCore([PoolSpec(64, 4)], ControllerOptions(
        scheduler=SchedulerConfig(max_num_batched_tokens=8)))
    request = core.add_request(list(range(1, 40)), SamplingParams(max_tokens=2))
    runner = FakeRunner(core.scheduler(0))
    StepLoop.serial(core, 0, runner.execute).step()  # the first chunk: 8 of 39 tokens
    protections = core.workers[0].protections
    assert protections._prefills
    assert core.abort(request.request_id) is not None
    assert not protections._prefills
    core.check_integrity()


def test_every_request_gets_a_sampling_seed_so_recompute_draws_the_same_tokens():
    core = ControllerCore([PoolSpec(64, 4)])
    a = core.add_request([1, 2, 3], SamplingParams(temperature=1.0), request_id="a")
    b = core.add_request([1, 2, 3], SamplingParams(temperature=1.0), request_id="b")
    own = core.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=7), request_id="c")
    assert a.sampling_params.seed is not None and b.sampling_params.seed is not None
    assert a.sampling_params.seed != b.sampling_params.seed  # ids differ, so do seeds
    assert own.sampling_params.seed == 7  # a client's seed is kept
    again = ControllerCore([PoolSpec(64, 4)])
    assert again.add_request([9], SamplingParams(), request_id="a").sampling_params.seed == \
        a.sampling_params.seed  # stable across processes: a resumed request keeps it

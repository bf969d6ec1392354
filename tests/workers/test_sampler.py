"""Sampler: filters, greedy rows, seeded determinism."""

from __future__ import annotations

import math

import torch

from controller.messages import SamplingParams
from workers.sampler import Sampler, SamplingRow, apply_top_k, apply_top_p, derive_seed

NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> list[bool]:
    return [bool(x) for x in torch.isfinite(logits[0])]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    assert kept(apply_top_k(logits, torch.tensor([2]))) == [False, True, False, True]
    assert kept(apply_top_k(logits, torch.tensor([1]))) == [False, True, False, False]
    for off in (0, -1, 10):  # disabled, or larger than the vocabulary
        assert kept(apply_top_k(logits, torch.tensor([off]))) == [True] * 4


def test_top_k_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([1, 0]))
    assert torch.isfinite(out).tolist() == [[False, False, True], [True, True, True]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    assert kept(apply_top_p(logits, torch.tensor([0.5]))) == [False, True, False, False]
    assert kept(apply_top_p(logits, torch.tensor([0.6]))) == [False, True, False, True]
    assert kept(apply_top_p(logits, torch.tensor([0.9]))) == [False, True, True, True]
    assert kept(apply_top_p(logits, torch.tensor([1.0]))) == [True] * 4
    assert kept(apply_top_p(logits, torch.tensor([1e-6]))) == [False, True, False, False]


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0)] * 4
    assert Sampler()(logits, rows) == logits.argmax(-1).tolist()
    # Ties take the first maximum and a NaN wins, as argmax does (the sampler takes max's
    # indices): rows of few distinct values over a vocabulary of 32,000.
    ties = torch.randint(0, 4, (6, 32000), generator=torch.Generator().manual_seed(1)).float()
    ties[2, 31_999] = ties[2].max() + 1
    ties[4, 7] = float("nan")
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0)] * 6
    want = ties.argmax(-1).tolist()
    assert want[4] == 7 and want[2] == 31_999 and len(set(want)) > 1
    assert Sampler()(ties, rows) == want


def test_seeded_rows_are_deterministic_and_batch_independent():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=7)
    free = SamplingParams(temperature=1.0)
    alone = Sampler(seed=0)(logits[1:2], [SamplingRow(seeded, 5)])
    mixed = Sampler(seed=123)(
        logits, [SamplingRow(free, 0), SamplingRow(seeded, 5), SamplingRow(free, 3)]
    )
    assert mixed[1] == alone[0]
    draws = {Sampler()(logits[1:2], [SamplingRow(seeded, k)])[0] for k in range(20)}
    assert len(draws) > 1  # the output index feeds the seed
    assert derive_seed(7, 5) == derive_seed(7, 5) != derive_seed(7, 6)


def test_unseeded_rows_follow_the_worker_generator():
    logits = torch.zeros(1, 1000)
    row = [SamplingRow(SamplingParams(temperature=1.0), 0)]
    first, second = Sampler(seed=3), Sampler(seed=3)
    seq_a = [first(logits, row)[0] for _ in range(5)]
    seq_b = [second(logits, row)[0] for _ in range(5)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_sampling_respects_filters_and_distribution():
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    sampler = Sampler(seed=0)
    top_k = SamplingRow(SamplingParams(temperature=1.0, top_k=2), 0)
    top_p = SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), 0)
    draws = [sampler(logits, [top_k])[0] for _ in range(2000)]
    assert 2 not in draws
    assert abs(draws.count(0) / len(draws) - 2 / 3) < 0.05
    assert {sampler(logits, [top_p])[0] for _ in range(50)} == {0}
    cold = SamplingRow(SamplingParams(temperature=1e-4), 0)
    assert {sampler(logits, [cold])[0] for _ in range(50)} == {0}


# ---- sampling where the logits are (the CUDA path; these run it on CPU) -----------------------
def test_hash_uniform_is_uniform_and_deterministic():
    from workers.sampler import hash_uniform

    u = hash_uniform(torch.tensor([3, 4]), 200_000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.std()) - 12 ** -0.5) < 0.005
    assert torch.equal(hash_uniform(torch.tensor([4]), 100), u[1:, :100])
    assert float((u[0] - u[1]).abs().mean()) > 0.3  # seeds give independent streams


def test_on_device_greedy_rows_take_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0)] * 4
    assert Sampler().on_device(logits, rows) == logits.argmax(-1).tolist()


def test_on_device_seeded_rows_are_deterministic_and_batch_independent():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingRow(SamplingParams(temperature=1.0, seed=7), 5)
    greedy = SamplingRow(SamplingParams(temperature=0.0), 0)
    alone = Sampler(seed=1).on_device(logits[1:2], [seeded])
    mixed = Sampler(seed=2).on_device(logits, [greedy, seeded, greedy])
    assert mixed[1] == alone[0]
    # The k-th output token gets its own draw: over k the tokens vary.
    draws = {Sampler().on_device(logits[1:2], [SamplingRow(seeded.params, k)])[0]
             for k in range(30)}
    assert len(draws) > 5


def test_on_device_draws_follow_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(4000, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=3, seed=s), 0) for s in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().on_device(logits, rows)), minlength=4)
    assert counts[3] == 0  # cut by top_k
    freq = counts[:3].float() / 4000
    torch.testing.assert_close(freq, probs[:3] / probs[:3].sum(), atol=0.03, rtol=0)
    unseeded = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.7), 0)] * 4000
    counts = torch.bincount(torch.tensor(Sampler(seed=3).on_device(logits, unseeded)),
                            minlength=4)
    assert counts[2] == counts[3] == 0  # top_p 0.7 keeps the two most likely tokens
    torch.testing.assert_close(counts[:2].float() / 4000, torch.tensor([0.625, 0.375]),
                               atol=0.03, rtol=0)


def test_parameters_in_the_metadata_upload_sample_as_a_separate_copy():
    """The worker's CUDA path: the random rows' parameters packed into the step's one
    metadata upload (floats as float64 bits), sampled from those views, equal the draws of
    `ids_on_device`, which copies them itself; a greedy-only step adds nothing."""
    from workers.attention import HostStaging, SeqSpan, StepMetadata

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0),
            SamplingRow(SamplingParams(temperature=0.7, top_p=0.9, seed=5), 3),
            SamplingRow(SamplingParams(temperature=1.3, top_k=7), 0),
            SamplingRow(SamplingParams(temperature=0.35, top_k=3, top_p=0.8, seed=9), 1)]
    plan = Sampler(seed=4).device_sampling(rows)
    assert plan is not None and plan.has_top_k and plan.has_top_p
    spans = [SeqSpan(i, 1, 3, [i]) for i in range(4)]
    meta = StepMetadata.build(spans, [1, 2, 3, 4], 16, HostStaging(torch.device("cpu")),
                              logits_indices=range(4), extra=plan.arrays)
    assert meta.logits_indices.tolist() == [0, 1, 2, 3]  # the metadata itself is unchanged
    index, temps, top_k, top_p, seeds = meta.extra
    assert index.tolist() == [1, 2, 3] and top_k.tolist() == [0, 7, 3]
    assert temps.view(torch.float64).tolist() == [0.7, 1.3, 0.35]
    assert top_p.view(torch.float64).tolist() == [0.9, 1.0, 0.8]
    assert seeds.tolist()[0] == derive_seed(5, 3) and seeds.tolist()[2] == derive_seed(9, 1)
    got = Sampler(seed=4).sample_on_device(logits, plan, meta.extra)
    want = Sampler(seed=4).ids_on_device(logits, rows)
    assert got.tolist() == want.tolist()
    assert Sampler().device_sampling(rows[:1]) is None

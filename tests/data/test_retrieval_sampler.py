"""The global no-duplicate sampler loses no example by default (issue 13, item 3): examples
deferred for a repeated text fill the epoch's last batches, only a final partial global batch can
be left out, and what an epoch leaves out is counted (``unused``, ``duplicate_batches``) the same
on every rank."""

import random

import pytest

from ds_infcl.data.retrieval import GlobalNoDuplicatesBatchSampler, RetrievalExample, example_texts

GLOBAL_BATCH = 32


def faq_texts(seed=0):
    """The FAQ case: 240 rows, 120 of whose queries share one positive (the other 120 unique)."""
    examples = [RetrievalExample(f"how do I do thing {i}", ["see the FAQ"]) for i in range(120)]
    examples += [RetrievalExample(f"question {i}", [f"answer {i}"]) for i in range(120)]
    random.Random(seed).shuffle(examples)
    return [example_texts(e) for e in examples]


def _epoch(texts, world_size, **kwargs):
    """Every rank's batches for one epoch, and the samplers."""
    samplers = [GlobalNoDuplicatesBatchSampler(texts, GLOBAL_BATCH, world_size=world_size, rank=r, **kwargs)
                for r in range(world_size)]
    return [list(s) for s in samplers], samplers


def test_faq_strict_rule_reproduced_with_drop():
    # what every run did before: 3 global batches (one "see the FAQ" each), 96 of 240 examples
    per_rank, (sampler,) = _epoch(faq_texts(), 1, duplicates="drop")
    assert sum(len(b) for b in per_rank[0]) == 96 == 240 - sampler.unused
    assert sampler.unused == 144 and sampler.duplicate_batches == 0 and len(sampler) == 3


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_faq_every_example_used_but_a_partial_batch(world_size):
    texts = faq_texts()
    per_rank, samplers = _epoch(texts, world_size)
    used = [i for rank_batches in per_rank for batch in rank_batches for i in batch]
    assert len(used) == len(set(used))  # no example twice
    assert 240 - len(used) == samplers[0].unused == 240 % GLOBAL_BATCH == 16  # only the partial batch
    assert all(len(s) == len(per_rank[0]) == 7 for s in samplers)  # __len__ is exact
    # batches with a repeated text: exactly the ones counted (the 4 that take deferred examples)
    repeats = 0
    for step in range(7):
        global_batch = [i for r in range(world_size) for i in per_rank[r][step]]
        texts_in = [t for i in global_batch for t in set(texts[i])]
        repeats += len(texts_in) != len(set(texts_in))
    assert repeats == samplers[0].duplicate_batches == 4
    # every rank reports the same counts
    assert {(s.unused, s.duplicate_batches) for s in samplers} == {(16, 4)}


@pytest.mark.parametrize("duplicates", ["defer", "allow", "drop"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shares_disjoint_equal_and_cover_the_global_batch(duplicates, world_size):
    texts = faq_texts(seed=3)
    per_rank, samplers = _epoch(texts, world_size, duplicates=duplicates, seed=5)
    global_batches = samplers[0].global_batches()
    assert all(len(b) == GLOBAL_BATCH for b in global_batches)
    for r in range(world_size):
        assert len(per_rank[r]) == len(global_batches)
        assert all(len(share) == GLOBAL_BATCH // world_size for share in per_rank[r])
    for step, batch in enumerate(global_batches):
        shares = [per_rank[r][step] for r in range(world_size)]
        assert [i for s in shares for i in s] == batch  # contiguous shares, disjoint, all of it
    used = sum(len(b) for b in global_batches)
    assert used + samplers[0].unused == len(texts)


def test_allow_is_a_plain_shuffled_partition():
    texts = faq_texts()
    sampler = GlobalNoDuplicatesBatchSampler(texts, GLOBAL_BATCH, duplicates="allow", seed=2)
    batches = sampler.global_batches()
    flat = [i for b in batches for i in b]
    order = list(range(240))
    random.Random("2:0").shuffle(order)
    assert flat == order[:224] and sampler.unused == 16
    assert sampler.duplicate_batches == sum(
        1 for b in batches if sum(texts[i][1] == "see the FAQ" for i in b) > 1
    )


@pytest.mark.parametrize("duplicates", ["defer", "allow", "drop"])
def test_deterministic_per_epoch(duplicates):
    texts = faq_texts()

    def run(epoch):
        sampler = GlobalNoDuplicatesBatchSampler(texts, GLOBAL_BATCH, world_size=2, rank=1, seed=7,
                                                 duplicates=duplicates)
        sampler.set_epoch(epoch)
        return list(sampler), sampler.unused, sampler.duplicate_batches

    assert run(0) == run(0) and run(3) == run(3)
    assert run(0)[0] != run(1)[0]
    # counts follow set_epoch on a live sampler
    sampler = GlobalNoDuplicatesBatchSampler(texts, GLOBAL_BATCH, seed=7, duplicates=duplicates)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert (len(sampler), sampler.unused) == (len(run(epoch)[0]), run(epoch)[1])


def test_drop_last_false_keeps_the_partial_batch():
    texts = faq_texts()
    sampler = GlobalNoDuplicatesBatchSampler(texts, GLOBAL_BATCH, drop_last=False)
    batches = sampler.global_batches()
    assert sorted(i for b in batches for i in b) == list(range(240))
    assert sampler.unused == 0 and len(batches[-1]) == 16 and len(sampler) == 8


def test_no_repeats_means_no_change():
    # without shared texts "defer" and "drop" give the same batches (the strict rule never bites)
    texts = [(f"q{i}", f"d{i}") for i in range(100)]
    defer = GlobalNoDuplicatesBatchSampler(texts, 8, seed=1)
    drop = GlobalNoDuplicatesBatchSampler(texts, 8, seed=1, duplicates="drop")
    assert defer.global_batches() == drop.global_batches()
    assert defer.unused == drop.unused == 4 and defer.duplicate_batches == 0

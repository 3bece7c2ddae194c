"""The global batch order and the built-in data."""

from __future__ import annotations

import torch

from gearshift.workers.step.data import CharCorpus, GlobalBatches, SyntheticDigits, make_corpus


def test_global_batch_is_the_same_for_any_number_of_workers():
    order = GlobalBatches(100, 12, seed=5)
    for step in range(20):
        whole = order.indices(step)
        for world in (1, 2, 3, 4, 6):
            shards = [order.shard(step, r, world) for r in range(world)]
            assert all(len(s) == 12 // world for s in shards)
            assert sum(shards, []) == whole


def test_every_sample_once_per_pass_even_across_a_batch_that_straddles_passes():
    order = GlobalBatches(10, 4, seed=1)  # 10 samples, batches of 4: step 2 straddles pass 0 and 1
    stream = sum((order.indices(s) for s in range(5)), [])
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a new permutation per pass


def test_order_is_deterministic_and_seeded():
    a, b, c = GlobalBatches(50, 8, 3), GlobalBatches(50, 8, 3), GlobalBatches(50, 8, 4)
    assert [a.indices(s) for s in range(9)] == [b.indices(s) for s in range(9)]
    assert a.indices(0) != c.indices(0)
    # asking out of order (a resume) gives the same answer
    assert GlobalBatches(50, 8, 3).indices(7) == a.indices(7)


def test_synthetic_digits_is_mnist_shaped_and_deterministic():
    ds = SyntheticDigits(size=64)
    x, y = ds[3]
    assert x.shape == (1, 28, 28) and 0 <= int(y) < 10
    assert torch.equal(SyntheticDigits(size=64).inputs, ds.inputs)


def test_char_corpus_targets_are_the_next_characters():
    ds = CharCorpus(seq_len=16, chars=5000)
    x, y = ds[2]
    assert x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1]) and int(x.max()) < 128
    text = make_corpus(2000)
    assert text == make_corpus(2000) and text.count(" ") > 200


def test_builtin_fast_batches_equal_per_sample_collation():
    from torch.utils.data import default_collate

    from gearshift.workers.step.data import load_batch

    idx = [5, 0, 17, 17, 3]
    for ds in (SyntheticDigits(size=32), CharCorpus(seq_len=8, chars=500)):
        fast = load_batch(ds, idx)
        slow = default_collate([ds[i] for i in idx])
        assert all(torch.equal(a, b) for a, b in zip(fast, slow))

from __future__ import annotations

import pytest

from simpletuner.data.discovery import DatasetError, DatasetSamples, Sample
from simpletuner.data.sampler import BucketBatchSampler


def samples(n, bucket=(128, 128), prefix="img"):
    return [Sample("ds", f"/{prefix}{i}.png", f"cap {i}", bucket, bucket, (0, 0, *bucket)) for i in range(n)]


def test_batches_share_a_bucket_and_are_deterministic():
    ds = DatasetSamples("ds", samples(6) + samples(4, (192, 128), "wide"))
    sampler = BucketBatchSampler([ds], batch_size=2, seed=7)
    assert sampler.batches_per_epoch == 5
    batches = sampler.epoch_batches(0)
    assert all(len({s.bucket for s in b}) == 1 for b in batches)
    assert batches == BucketBatchSampler([ds], 2, 7).epoch_batches(0)
    assert batches != sampler.epoch_batches(1)  # a new shuffle each epoch


def test_repeats_multiply_the_epoch():
    sampler = BucketBatchSampler([DatasetSamples("ds", samples(4), repeats=2)], batch_size=2, seed=0)
    assert sampler.batches_per_epoch == 6
    seen = [s.path for b in sampler.epoch_batches(0) for s in b]
    assert sorted(seen) == sorted([f"/img{i}.png" for i in range(4)] * 3)


def test_too_few_images_for_a_batch_explains_the_fix():
    ds = DatasetSamples("tiny-set", samples(1) + samples(1, (192, 128), "w"))
    with pytest.raises(DatasetError, match="No images detected") as err:
        BucketBatchSampler([ds], batch_size=2, seed=0)
    assert "repeats" in str(err.value) and "tiny-set" in str(err.value)


def _two(p_a, p_b, n=6):
    a = DatasetSamples("a", [Sample("a", f"/a{i}.png", "a", (128, 128), (128, 128), (0, 0, 128, 128)) for i in range(n)],
                       probability=p_a)
    b = DatasetSamples("b", [Sample("b", f"/b{i}.png", "b", (128, 128), (128, 128), (0, 0, 128, 128)) for i in range(n)],
                       probability=p_b)
    return BucketBatchSampler([a, b], batch_size=1, seed=3)


def test_probability_weights_which_dataset_each_batch_comes_from():
    """As SimpleTuner documents it: 0.7 / 0.3 draws 70% / 30% of the batches while both datasets last; an epoch
    still shows every image once, and a dataset is never mixed into another's batch."""
    rare = [b[0].dataset_id for b in _two(1.0, 0.001).epoch_batches(0)]
    even = [b[0].dataset_id for b in _two(1.0, 1.0).epoch_batches(0)]
    assert rare[:6] == ["a"] * 6  # dataset b is (all but) never drawn while a lasts
    assert 2 <= even[:6].count("b") <= 4
    assert sorted(rare) == sorted(even) == ["a"] * 6 + ["b"] * 6
    many = BucketBatchSampler([DatasetSamples("a", samples(300), probability=0.7),
                               DatasetSamples("b", samples(300, prefix="b"), probability=0.3)], 1, 0)
    first = [b[0].path.startswith("/img") for b in many.epoch_batches(0)[:200]]
    assert 0.62 < sum(first) / 200 < 0.78
    assert _two(1.0, 0.3).epoch_batches(2) == _two(1.0, 0.3).epoch_batches(2)  # deterministic, so resumable

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

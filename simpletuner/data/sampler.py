"""Deterministic aspect-bucketed batches.

Epoch ``e`` of a run seeded ``s`` always yields the same batches in the same order, so a resumed run continues
from (epoch, batch index) and sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from collections import defaultdict

from simpletuner.data.discovery import DatasetError, DatasetSamples, Sample


class BucketBatchSampler:
    def __init__(self, datasets: list[DatasetSamples], batch_size: int, seed: int):
        self.batch_size = batch_size
        self.seed = seed
        self.items: list[Sample] = []
        for ds in datasets:
            self.items.extend(ds.samples * (1 + ds.repeats))
        self.datasets = datasets
        buckets = defaultdict(int)
        for s in self.items:
            buckets[s.bucket] += 1
        self.batches_per_epoch = sum(n // batch_size for n in buckets.values())
        if self.batches_per_epoch == 0:
            raise DatasetError(self._too_small_message(buckets))

    def _too_small_message(self, buckets) -> str:
        found = ", ".join(f"{ds.dataset_id}: {len(ds.samples)} usable image(s), repeats={ds.repeats}"
                          for ds in self.datasets)
        sizes = ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(buckets.items())) or "none"
        return (
            f"No images detected that can fill one batch of train_batch_size={self.batch_size} "
            f"({found}; samples per aspect bucket: {sizes}). Every batch comes from one aspect bucket. "
            f"Fix: add images, lower train_batch_size, or raise `repeats` on the dataset in multidatabackend.json."
        )

    def epoch_batches(self, epoch: int) -> list[list[Sample]]:
        rng = random.Random(self.seed * 100_003 + epoch)
        order = list(range(len(self.items)))
        rng.shuffle(order)
        by_bucket: dict[tuple[int, int], list[Sample]] = defaultdict(list)
        for i in order:
            by_bucket[self.items[i].bucket].append(self.items[i])
        batches = []
        for bucket in sorted(by_bucket):
            group = by_bucket[bucket]
            for start in range(0, len(group) - self.batch_size + 1, self.batch_size):
                batches.append(group[start:start + self.batch_size])
        rng.shuffle(batches)
        return batches

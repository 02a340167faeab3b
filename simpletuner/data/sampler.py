"""Deterministic aspect-bucketed batches, drawn from the datasets by their ``probability``.

Every batch comes from one dataset and one aspect bucket. With several datasets, each batch's dataset is drawn
with a chance proportional to its ``probability`` among the datasets that still have batches left this epoch (as
SimpleTuner's multi-dataset sampler does: 0.7 / 0.3 samples 70% / 30% of the batches while both last); the epoch
ends when every dataset has been seen ``1 + repeats`` times. Epoch ``e`` of a run seeded ``s`` always yields the
same batches in the same order, so a resumed run continues from (epoch, batch index) and sees exactly the batches
an uninterrupted run would.
"""

from __future__ import annotations

import random
from collections import defaultdict

from simpletuner.data.discovery import DatasetError, DatasetSamples, Sample


class BucketBatchSampler:
    def __init__(self, datasets: list[DatasetSamples], batch_size: int, seed: int):
        self.batch_size = batch_size
        self.seed = seed
        self.datasets = datasets
        self.items_per_dataset: list[list[Sample]] = [ds.samples * (1 + ds.repeats) for ds in datasets]
        self.items: list[Sample] = [s for items in self.items_per_dataset for s in items]
        self.weights = [float(getattr(ds, "probability", 1.0)) for ds in datasets]
        buckets = defaultdict(int)
        self.batches_per_epoch = 0
        for items in self.items_per_dataset:
            mine = defaultdict(int)
            for s in items:
                mine[s.bucket] += 1
                buckets[s.bucket] += 1
            self.batches_per_epoch += sum(n // batch_size for n in mine.values())
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
        per_dataset = [self._dataset_batches(items, rng) for items in self.items_per_dataset]
        if len(per_dataset) == 1:
            return per_dataset[0]
        remaining = [list(reversed(b)) for b in per_dataset]  # pop() from the end = next in order
        batches = []
        while True:
            live = [i for i, left in enumerate(remaining) if left]
            if not live:
                return batches
            chosen = rng.choices(live, weights=[self.weights[i] for i in live])[0]
            batches.append(remaining[chosen].pop())

    def _dataset_batches(self, items: list[Sample], rng: random.Random) -> list[list[Sample]]:
        order = list(range(len(items)))
        rng.shuffle(order)
        by_bucket: dict[tuple[int, int], list[Sample]] = defaultdict(list)
        for i in order:
            by_bucket[items[i].bucket].append(items[i])
        batches = []
        for bucket in sorted(by_bucket):
            group = by_bucket[bucket]
            for start in range(0, len(group) - self.batch_size + 1, self.batch_size):
                batches.append(group[start:start + self.batch_size])
        rng.shuffle(batches)
        return batches

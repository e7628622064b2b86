"""The data loader the trainer uses: micro-batches for one data-parallel rank.

Sample order follows Megatron's pretraining sampler. Global batch `g` holds the samples
`[start + g * G, start + (g + 1) * G)` (`G` = global batch size); it is consumed as
`G / (micro * dp)` micro-steps, and micro-step `m` gives rank `r` the samples
`base + m * micro * dp + r * micro + [0, micro)`. So the ranks together read exactly the
global batch, each rank only its slice, and resuming from `consumed_samples` (counted in
global samples, the same on every rank) continues the same sequence.

A background thread assembles the next micro-batches while the trainer computes; the time
the trainer spent waiting for data is in `wait_s` (the trainer logs `data_wait_frac`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import numpy as np

_END = object()


class DataLoader:
    """Iterate micro-batches (dicts of numpy arrays) for one data-parallel rank."""

    def __init__(
        self,
        dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        total_samples: int | None = None,
        start_sample: int = 0,
        prefetch: int = 4,
    ) -> None:
        if micro_batch_size < 1 or global_batch_size < 1 or dp_size < 1:
            raise ValueError("batch sizes and dp_size must be positive")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size {global_batch_size} is not a multiple of "
                f"micro_batch_size * dp_size = {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if consumed_samples % global_batch_size:
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of "
                f"global_batch_size {global_batch_size}"
            )
        available = len(dataset) - start_sample
        if total_samples is None:
            total_samples = available
        if total_samples > available:
            raise ValueError(
                f"the dataset holds {available} samples from {start_sample}, "
                f"the run needs {total_samples}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.start_sample = start_sample
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.prefetch = max(1, prefetch)
        self.wait_s = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def micro_steps_per_global_batch(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def num_global_batches(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def indices(self, consumed_samples: int | None = None) -> Iterator[np.ndarray]:
        """Sample indices of this rank's micro-batches, from `consumed_samples` on."""
        consumed = self.consumed_samples if consumed_samples is None else consumed_samples
        mb, dp = self.micro_batch_size, self.dp_size
        while consumed + self.global_batch_size <= self.total_samples:
            base = self.start_sample + consumed
            for m in range(self.micro_steps_per_global_batch):
                lo = base + m * mb * dp + self.dp_rank * mb
                yield np.arange(lo, lo + mb, dtype=np.int64)
            consumed += self.global_batch_size

    def global_batch_indices(self, consumed_samples: int) -> np.ndarray:
        """All sample indices of the global batch that starts at `consumed_samples`."""
        base = self.start_sample + consumed_samples
        return np.arange(base, base + self.global_batch_size, dtype=np.int64)

    def _produce(self, q: queue.Queue, consumed: int) -> None:
        try:
            for idx in self.indices(consumed):
                batch = self.dataset.get_batch(idx)
                while not self._stop.is_set():
                    try:
                        q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            q.put(_END)
        except BaseException as exc:  # surfaced in the consumer's thread
            q.put(exc)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.close()
        self._stop = threading.Event()
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce, args=(q, self.consumed_samples), daemon=True
        )
        self._thread.start()
        per_global = self.micro_steps_per_global_batch
        step = 0
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self.wait_s += time.perf_counter() - t0
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                step += 1
                if step % per_global == 0:
                    self.consumed_samples += self.global_batch_size
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}


def build_dataloader(
    dataset,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    consumed_samples: int = 0,
    total_samples: int | None = None,
    start_sample: int = 0,
    prefetch: int = 4,
) -> DataLoader:
    """A `DataLoader` over `dataset` (a `PackedDataset` or `BlendedDataset`)."""
    return DataLoader(
        dataset,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        consumed_samples=consumed_samples,
        total_samples=total_samples,
        start_sample=start_sample,
        prefetch=prefetch,
    )

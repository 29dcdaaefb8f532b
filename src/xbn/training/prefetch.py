"""`DeviceBatches`: the training batches moved to the device and prepared there (the cached path's batch stage of
the augmentation, `data.augment_on: device`) by a background thread, a few batches ahead of the step.

Why a thread: the batch stage is a few hundred small kernels whose launches cost the CPU a few milliseconds. Run
inline, they would start only after the previous step's `loss.item()` returned, with the GPU idle meanwhile. From a
thread they are launched while the training thread waits for the GPU, and on a side CUDA stream they run beside
the step's kernels; the step's stream waits for the batch's event before using it. The thread drives the
DataLoader iterator itself, so batches arrive in the sampler's order (`RequestedBatches` sees them in order).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class DeviceBatches:
    """Iterate `loader`'s `(images, labels, indices)` batches with `prepare(images)` (and the labels' copy) done
    on `device` by a background thread, at most `depth` batches ahead. On CUDA the work goes to a side stream and
    each batch is handed over with an event; elsewhere (tests) the thread alone. An error in the loader or in
    `prepare` is raised in the consumer, and a consumer that stops early (or fails) stops the thread."""

    def __init__(self, loader: Iterable, prepare: Callable[[Any], torch.Tensor], device: torch.device,
                 depth: int = 2) -> None:
        self.loader, self.prepare, self.device, self.depth = loader, prepare, torch.device(device), depth

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        cuda = self.device.type == "cuda"
        handoff: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        stream = torch.cuda.Stream(self.device) if cuda else None

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work() -> None:
            try:
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for images, labels, indices in self.loader:
                        images = self.prepare(images)
                        labels = labels.to(self.device, non_blocking=True)
                        event = None
                        if cuda:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not put((images, labels, indices, event)):
                            return
                put(_END)
            except BaseException as error:  # noqa: BLE001 - not swallowed: handed to the consumer, raised there
                put(_Failure(error))

        thread = threading.Thread(target=work, name="xbn-device-batches", daemon=True)
        thread.start()
        try:
            while True:
                item = handoff.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                images, labels, indices, event = item
                if cuda:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    images.record_stream(current)  # the allocator must not reuse them while the step runs
                    labels.record_stream(current)
                yield images, labels, indices
        finally:
            stop.set()
            thread.join(timeout=60)

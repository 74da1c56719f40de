"""Reassembling the loader's batches: ``Rebatch`` turns worker batches of any size into batches of
exactly the rank's size (decoding them on the device first for ``decode: gpu``), and
``ThreadedPrefetch`` prepares the next one in a background thread while the current one trains.

Why: a worker that builds a whole 16k batch of 224 px images holds 2.5 GB in shared memory and
needs about a minute of one core (~270 images/s) before the first step; workers building batches of a few hundred keep the
shared memory small and the first step early, and the rank assembles them (into pinned memory, the
copy the trainer would make anyway, in the prefetch thread).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

__all__ = ["Rebatch", "ThreadedPrefetch"]


class Rebatch:
    """Batches of exactly ``batch_size`` samples from the loader's worker batches of any size.

    Each raw batch's reader counts go to ``tally`` (``tally.update``). With a ``decoder``
    (``JpegBatchDecoder``), its packed JPEGs are decoded on the device first; an image that cannot
    be decoded is dropped, counted in ``tally`` as ``bad_image`` (as the CPU path counts it) and
    its place filled from the next raw batch. With ``pin``, host images are assembled straight
    into pinned memory (the copy the trainer's pinning would make; it leaves pinned tensors as
    they are).

    With ``defer_counts``, the counts are not applied as raw batches are read but attached to the
    batch they lead to (key ``COUNTS``) and applied by ``count(batch)`` when the consumer takes it:
    behind a prefetch thread, which reads ahead by a timing-dependent amount, the tally then
    stays that of the batches handed out (the same as an inline ``Rebatch``'s after as many).

    Iterating yields dicts with the raw batches' per-sample fields (``idx``, ``label``, ``text``,
    the tokenizer's tensors) and ``image`` (``[batch_size, 3, S, S]``). A finite stream's last
    partial batch is counted as ``dropped_last_batch``.
    """

    def __init__(self, raw_batches: Iterator[Dict[str, Any]], batch_size: int, tally, *,
                 decoder: Optional[Callable] = None, pin: bool = False,
                 on_failure: Optional[Callable[[str], None]] = None, defer_counts: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.raw = raw_batches
        self.decoder = decoder
        self.batch_size = batch_size
        self.tally = tally
        self.pin = pin
        self.on_failure = on_failure
        self.defer_counts = defer_counts
        self._pieces: List[Dict[str, Any]] = []
        self._held = 0

    COUNTS = "tally_counts"

    def _apply(self, records) -> None:
        for kind, payload in records:
            if kind == "update":
                self.tally.update(payload)
            else:
                self.tally.add(*payload)

    def count(self, batch: Dict[str, Any]) -> None:
        """Apply the counts attached to ``batch`` (``defer_counts``; nothing otherwise)."""
        self._apply(batch.get(self.COUNTS, ()))

    @staticmethod
    def _select(batch: Dict[str, Any], keep: Optional[torch.Tensor], n: int) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in batch.items():
            if key in ("image", "bad_samples", "reader"):
                continue
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
                out[key] = value if keep is None else value[keep.to(value.device)]
            elif isinstance(value, list) and len(value) == n:
                out[key] = value if keep is None else [value[i] for i in keep.tolist()]
        return out

    def _take(self, count: int) -> Dict[str, Any]:
        """The first ``count`` held samples as one batch (pieces split where needed)."""
        parts, need = [], count
        while need:
            piece = self._pieces[0]
            m = len(piece["image"])
            if m <= need:
                parts.append(self._pieces.pop(0))
                need -= m
            else:
                parts.append({k: v[:need] for k, v in piece.items()})
                self._pieces[0] = {k: v[need:] for k, v in piece.items()}
                need = 0
        self._held -= count
        out = {}
        for k in parts[0]:
            values = [p[k] for p in parts]
            if not torch.is_tensor(values[0]):
                out[k] = sum(values, [])
            elif k == "image" and self.pin and not values[0].is_cuda:
                out[k] = torch.empty((count,) + tuple(values[0].shape[1:]), dtype=values[0].dtype, pin_memory=True)
                torch.cat(values, out=out[k])
            else:
                out[k] = values[0] if len(values) == 1 else torch.cat(values)
        return out

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        pending: List[Any] = []

        def record(kind: str, payload) -> None:
            if self.defer_counts:
                pending.append((kind, payload))
            else:
                self._apply([(kind, payload)])

        for raw in self.raw:
            record("update", {"reader": raw["reader"], "bad_samples": raw["bad_samples"]})
            if self.decoder is None:
                images, keep, failures = raw["image"], None, []
                n = len(images)
            else:
                images, ok, failures = self.decoder(raw["image"])
                n = len(ok)
                keep = None if bool(ok.all()) else torch.nonzero(ok).flatten()
            if keep is not None:
                record("add", ("bad_image", n - len(keep)))
                for message in failures:
                    if self.on_failure is not None:
                        self.on_failure(message)
            piece = self._select(raw, keep, n)
            piece["image"] = images if keep is None else images[keep.to(images.device)]
            if len(piece["image"]):
                self._pieces.append(piece)
                self._held += len(piece["image"])
            while self._held >= self.batch_size:
                out = self._take(self.batch_size)
                if self.defer_counts:
                    out[self.COUNTS], pending = pending, []
                yield out
        self._apply(pending)  # the end of a finite stream: no batch left to carry them
        if self._held:
            self.tally.add("dropped_last_batch", self._held)
            self._pieces, self._held = [], 0


class ThreadedPrefetch:
    """Runs an iterator ``depth`` items ahead in a background thread, on a side CUDA stream when
    ``device`` is CUDA: the next batch's device decode overlaps this batch's training step (the
    decode's host work and its kernels; torch releases the GIL inside ops).

    Items come out in the iterator's order (one producer thread). A CUDA item is handed over with
    an event the consumer's current stream waits on, and its tensors are recorded on that stream
    (the caching allocator must not reuse their memory while the step reads them). An exception in
    the producer is raised by the consumer's ``next``; the end of the iterator ends this one.
    """

    _END = object()

    def __init__(self, iterator: Iterator[Any], device, depth: int = 1):
        import queue
        import threading

        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:  # the caller's current device, not the thread's
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._iterator = iterator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="ds_infcl-device-decode", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            stream = None
            if self._cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
                stream = torch.cuda.Stream(self.device)
            while not self._stop.is_set():
                if stream is not None:
                    with torch.cuda.stream(stream):
                        item = next(self._iterator, self._END)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    item, event = next(self._iterator, self._END), None
                self._queue.put((item, event, None))
                if item is self._END:
                    return
        except BaseException as exn:  # noqa: BLE001 -- handed to the consumer, which raises it
            self._queue.put((self._END, None, exn))

    def __iter__(self) -> "ThreadedPrefetch":
        return self

    def __next__(self) -> Any:
        item, event, error = self._queue.get()
        if error is not None:
            raise error
        if item is self._END:
            raise StopIteration
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)

            def keep(t):
                if torch.is_tensor(t) and t.is_cuda:
                    t.record_stream(current)

            for value in item.values() if isinstance(item, dict) else ():
                keep(value)
        return item

    def close(self, timeout: float = 30.0) -> None:
        """Stop producing: the thread ends after its current item. Waits at most ``timeout``
        seconds for that (a producer stuck in its iterator is left behind: it is a daemon)."""
        import time

        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get_nowait()
            except Exception:  # noqa: BLE001 -- queue.Empty: nothing to drain yet
                self._thread.join(timeout=0.05)

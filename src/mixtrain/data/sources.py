"""Where a worker's samples come from, in one interface: in-memory tensors read zero-copy from Ray's object
store, or a map-style Dataset read lazily, only at this worker's indices, through a DataLoader.

Augmentation keeps the math exact: around `dataset[i]` in epoch `e`, torch's CPU stream and the numpy and Python
`random` streams are seeded from `(seed, e, i)` (`seed_sample`), so a sample's random view depends on the sample,
not on which worker or loader process reads it. A single-process reference that calls
`seed_sample(seed, epoch, i)` before `dataset[i]` sees the same views.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import default_collate as _default_collate

from mixtrain import devices
from mixtrain.data.sampling import Arrays, as_tensors, to_arrays
from mixtrain.errors import InputTypeError, InputValueError

EVAL_EPOCH = -1
"""The epoch key held-out samples are read under (their random streams, if any, never change)."""


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed torch's CPU stream, numpy and Python `random` for reading sample `index` in `epoch` of a run with
    `seed`: the rule every mixtrain worker applies around `dataset[index]`."""
    _seed_streams(int(sample_seeds(seed, np.array([epoch]), np.array([index]))[0]))


def sample_seeds(seed: int, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The 64-bit seed of each sample `indices[k]` read in epoch `epochs[k]`, for a whole batch in a few array
    operations (splitmix64's mixing: a numpy SeedSequence per sample took longer than reading a small sample)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the mixing means it to
        h = _mix(np.full(len(indices), seed + 1, dtype=np.uint64) * _GOLDEN)
        h = _mix(h ^ (np.asarray(epochs, dtype=np.int64) + 1).astype(np.uint64) * _GOLDEN)
        return _mix(h ^ (np.asarray(indices, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _seed_streams(value: int) -> None:
    """torch's CPU generator (where a Dataset's transforms draw) rather than torch.manual_seed, which also seeds
    every CUDA, XPU and MTIA device and, before CUDA starts, formats a stack trace per device for its queue of
    lazy calls: 2-5 ms a sample, longer than the newcomer's whole step (issue 45)."""
    torch.default_generator.manual_seed(value)
    np.random.seed(value >> 32)
    random.seed(value & 0xFFFFFFFF)


@dataclass(frozen=True, kw_only=True)
class Loader:
    """A map-style Dataset with the options its DataLoader takes on every worker. Give a plain Dataset
    for the defaults, or `Loader(dataset=..., num_workers=4)` to set them."""

    dataset: Any
    """A map-style torch Dataset (`__len__`, `__getitem__`), or a zero-argument callable that builds one on
    each worker (files that exist on every machine)."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Makes a batch from samples (default: torch's default_collate; dicts, tuples and tensors nest)."""
    num_workers: int | None = None
    """Loader processes per worker (None: up to 2 where the node has CPUs to spare, else 0)."""
    prefetch_factor: int = 2
    """Micro-batches each loader process reads ahead, so loading overlaps compute."""
    pin_memory: bool | None = None
    """Page-locked host memory for faster copies to a GPU (None: on for CUDA)."""

    def __post_init__(self) -> None:
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            raise InputValueError(f"Loader.num_workers={self.num_workers!r}: must be an integer >= 0 or None")
        if self.prefetch_factor < 1:
            raise InputValueError(f"Loader.prefetch_factor={self.prefetch_factor!r}: must be >= 1")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise InputTypeError("Loader.collate_fn must be callable as collate_fn(list_of_samples) -> batch")
        if not callable(self.dataset) and not _is_map_dataset(self.dataset):
            raise InputTypeError(
                f"Loader.dataset of type {type(self.dataset).__name__}: give a map-style Dataset (with __len__ "
                f"and __getitem__) or a zero-argument function that returns one. {STREAM_FIX}"
            )

    @property
    def built_on_workers(self) -> bool:
        """The dataset is a function each worker calls (its own copy of the files)."""
        return callable(self.dataset) and not _is_map_dataset(self.dataset)


def _is_map_dataset(data: Any) -> bool:
    """Indexable by position with a length: a Dataset, or a list of samples (not a string, not a dict)."""
    if isinstance(data, (str, bytes, Mapping)):
        return False
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


STREAM_FIX = (
    "mixtrain needs a map-style Dataset (len() and indexing) to hand each worker its exact samples of every "
    "global batch in the seeded order, which a stream cannot give. Load it map-style instead (Hugging Face: "
    "load_dataset(...) without streaming=True, or a streamed slice made a list: list(stream.take(n))), or give "
    "a list of samples"
)


def _from_data_loader(loader: DataLoader, field: str) -> Arrays | Loader:
    """A DataLoader as data: its dataset, collate_fn and loader options are taken over; its batch size and order
    are not (global_batch and the seed decide them), and a note says so."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise InputTypeError(f"{field} is a DataLoader over an IterableDataset: {STREAM_FIX}")
    warnings.warn(
        f"{field}: a DataLoader; its dataset, collate_fn, num_workers and pin_memory are used, its batch_size "
        f"({loader.batch_size}) and shuffle/sampler are not: global_batch and the seed decide the batches",
        stacklevel=4,
    )
    if loader.collate_fn is _default_collate and not loader.num_workers:
        return describe(loader.dataset, field)  # a TensorDataset still travels as arrays
    return Loader(
        dataset=loader.dataset,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor or 2,
        pin_memory=loader.pin_memory or None,
    )


def describe(data: Any, field: str) -> Arrays | Loader:
    """What the driver ships for `data`: numpy arrays for tensors, arrays and TensorDatasets (zero-copy
    through the object store, the fastest for small data), else a Loader (read lazily on each worker)."""
    if isinstance(data, Loader):
        return data
    if isinstance(data, DataLoader):
        return _from_data_loader(data, field)
    streamed = hasattr(data, "__iter__") and not isinstance(data, (str, bytes, Mapping))
    if streamed and not _is_map_dataset(data) and not callable(data):
        raise InputTypeError(f"{field} of type {type(data).__name__} is a stream (iterable, no indexing): {STREAM_FIX}")
    if isinstance(data, (tuple, list)) and data and all(isinstance(x, (torch.Tensor, np.ndarray)) for x in data):
        return to_arrays(data)
    if isinstance(data, Dataset) and getattr(data, "tensors", None) is not None:
        return to_arrays(data)
    if callable(data) or _is_map_dataset(data):
        return Loader(dataset=data)
    raise InputTypeError(
        f"{field} of type {type(data).__name__} is not supported: give a tuple of tensors (inputs..., target), "
        "a map-style torch Dataset, a mixtrain.data.Loader, or a zero-argument function that returns a Dataset"
    )


def to_device(batch: Any, device: torch.device, where: str = "the batch") -> Any:
    """Move every tensor in `batch` (tensors, tuples, lists, dicts, nested, or anything with `.to(device)`
    such as a Hugging Face BatchEncoding) to `device`; other leaves (numbers, strings, None) stay."""
    if isinstance(batch, torch.Tensor):
        # non-blocking only into CUDA: to MPS a non-blocking copy of this (temporary) batch can be corrupted
        return batch.to(device, non_blocking=devices.get(device.type).non_blocking_copies)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, f"{where}[{k!r}]") for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device, where) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, f"{where}[{i}]") for i, v in enumerate(batch))
    if batch is None or isinstance(batch, (int, float, bool, str, bytes, np.ndarray)):
        return batch
    if callable(getattr(batch, "to", None)):
        return batch.to(device)
    raise InputTypeError(
        f"{where} holds a {type(batch).__name__}, which cannot be moved to {device}: make the collate function "
        "return tensors in tuples, lists or dicts (or objects with a .to(device) method)"
    )


class FirstSamples:
    """The first samples of the training data in epoch 0's views, each read once, with the seconds reading them
    took: the start-up checks (a sample's shape, the numerics check) and the probe make their batches of any size
    from them, repeating them past the end, so none of them reads a sample twice (an image folder or a remote
    store pays for every read)."""

    def __init__(self, fetch: Callable[[np.ndarray], list[Any]], assemble: Callable[[list[Any]], Any]) -> None:
        self._fetch, self._assemble = fetch, assemble
        self.samples: list[Any] = []
        self.read_s = 0.0
        """Seconds the reads of `samples` took, all together."""

    def extend(self, count: int, available: int) -> None:
        """Read the samples of the first `count` (at most `available`) not read yet."""
        have, want = len(self.samples), min(count, available)
        if want > have:
            t0 = time.perf_counter()
            self.samples += self._fetch(np.arange(have, want))
            self.read_s += time.perf_counter() - t0

    def batch(self, size: int) -> Any:
        """A batch of `size` of the samples read (the first ones, repeated when there are fewer)."""
        return self._assemble([self.samples[i % len(self.samples)] for i in range(size)])


class SampleSource:
    """Samples for one worker, by dataset index, in the order of the epoch's steps."""

    _first: FirstSamples | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, epoch: int, indices: np.ndarray) -> Any:
        """One batch of `indices`, read here (fingerprints)."""
        raise NotImplementedError

    def first(self, count: int) -> FirstSamples:
        """The first `count` samples (all of them in a smaller dataset) in epoch 0's views, each read once however
        often the start-up checks and the probe ask, until `forget_first`."""
        if self._first is None:
            self._first = FirstSamples(self._fetch, self._assemble)
        self._first.extend(count, len(self))
        return self._first

    def forget_first(self) -> None:
        """Let go of the samples `first` holds (the probe is done with them)."""
        self._first = None

    def _fetch(self, indices: np.ndarray) -> list[Any]:
        """The samples at `indices` in epoch 0's views, as `_assemble` takes them."""
        raise NotImplementedError

    def _assemble(self, samples: list[Any]) -> Any:
        """A batch of samples `_fetch` returned."""
        raise NotImplementedError

    def batches(self, epoch: int, chunks: Sequence[np.ndarray]) -> Iterator[Any]:
        """The batches of `chunks` (index arrays) in order, read ahead where the source can."""
        return (self.read(epoch, c) for c in chunks)

    def fingerprint(self) -> str:
        """A short hash of a few samples (epoch 0's views): equal datasets, equal fingerprints."""
        n = len(self)
        picks = sorted({0, n // 2, n - 1}) if n else []
        digest = hashlib.sha256()
        _digest(self.read(0, np.asarray(picks, dtype=np.int64)), digest)
        return digest.hexdigest()[:12]

    def close(self) -> None:
        """Stop loader processes, let go of held samples."""
        self.forget_first()


class TensorSource(SampleSource):
    """In-memory fields (inputs..., target) from the object store; a batch is a tuple of rows."""

    def __init__(self, arrays: Arrays, supports_float64: bool = True) -> None:
        fields = as_tensors(arrays)
        if not supports_float64:  # MPS: float64 fields become float32 here, on the CPU, once
            fields = tuple(f.float() if f.dtype == torch.float64 else f for f in fields)
        self.fields = fields

    def __len__(self) -> int:
        return len(self.fields[0])

    def read(self, epoch: int, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return tuple(f[index] for f in self.fields)

    def slice(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        return tuple(f[start:stop] for f in self.fields)

    def _fetch(self, indices: np.ndarray) -> list[Any]:
        return [int(i) for i in indices]  # rows are in memory already: gathering them is the batch's making

    def _assemble(self, samples: list[Any]) -> tuple[torch.Tensor, ...]:
        return self.read(0, np.asarray(samples, dtype=np.int64))


class _Seeded(Dataset):
    """Reads `(epoch, index)` keys: the base dataset's sample with the random streams seeded by the
    sample; the caller's streams are restored afterwards (dropout in this process stays untouched). A DataLoader
    reads a batch's keys in one `__getitems__`: the seeds are made for the batch at once and the streams saved and
    restored once a batch (numpy's state alone takes about 0.1 ms each way)."""

    def __init__(self, base: Any, seed: int) -> None:
        self.base = base
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        pairs = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
        seeds = sample_seeds(self.seed, pairs[:, 0], pairs[:, 1]).tolist()
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            out = []
            for value, index in zip(seeds, pairs[:, 1].tolist()):
                _seed_streams(value)
                out.append(self.base[index])
            return out
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


class _RoundBatches:
    """The batch sampler of a persistent DataLoader: yields whatever batches the round asks for next."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class DatasetSource(SampleSource):
    """A map-style Dataset read lazily through one DataLoader whose loader processes live as long as the
    worker (the batch sampler is refilled every round)."""

    def __init__(self, loader: Loader, seed: int, pin_memory: bool) -> None:
        dataset = loader.dataset() if loader.built_on_workers else loader.dataset  # built here: this machine's files
        if not _is_map_dataset(dataset):
            raise InputTypeError(
                f"the data function returned {type(dataset).__name__}; it must return a map-style Dataset "
                "(with __len__ and __getitem__)"
            )
        if len(dataset) == 0:
            raise InputValueError("the dataset is empty (len 0): give it at least one sample")
        self.seeded = _Seeded(dataset, seed)
        self.collate = loader.collate_fn or _default_collate
        self.sampler = _RoundBatches()
        num_workers = _default_loader_workers() if loader.num_workers is None else loader.num_workers
        self.loader = DataLoader(
            self.seeded,
            batch_sampler=self.sampler,
            collate_fn=self._collate,
            num_workers=num_workers,
            prefetch_factor=loader.prefetch_factor if num_workers else None,
            persistent_workers=num_workers > 0,
            generator=torch.Generator().manual_seed(seed),  # its base seeds never draw on this process's streams
            pin_memory=pin_memory if loader.pin_memory is None else loader.pin_memory,
        )

    def __len__(self) -> int:
        return len(self.seeded)

    def read(self, epoch: int, indices: np.ndarray) -> Any:
        return self._collate(self.seeded.__getitems__([(epoch, int(i)) for i in indices]))

    def batches(self, epoch: int, chunks: Sequence[np.ndarray]) -> Iterator[Any]:
        self.sampler.batches = [[(epoch, int(i)) for i in c] for c in chunks]
        return iter(self.loader)

    def _fetch(self, indices: np.ndarray) -> list[Any]:
        return self.seeded.__getitems__([(0, int(i)) for i in indices])

    def _assemble(self, samples: list[Any]) -> Any:
        return self._collate(samples)

    def _collate(self, samples: list[Any]) -> Any:
        try:
            return self.collate(samples)
        except Exception as exc:
            raise InputValueError(
                f"the collate function could not make a batch of {len(samples)} samples ({exc}). Every sample "
                "must have the same structure (the same tuple length or dict keys, tensors of one shape per "
                "field); give Loader(collate_fn=...) for samples that need padding"
            ) from exc

    def close(self) -> None:
        super().close()
        self.sampler.batches = []
        self.loader = None  # type: ignore[assignment]  # ends its loader processes


def _default_loader_workers() -> int:
    """Up to 2 loader processes where the node has CPUs to spare beyond the worker's own threads."""
    spare = (os.cpu_count() or 1) - torch.get_num_threads() - 1
    return max(0, min(2, spare))


def make_source(
    spec: Arrays | Loader, seed: int, *, supports_float64: bool = True, pin_memory: bool = False
) -> SampleSource:
    """The worker's source for what the driver shipped (see `describe`)."""
    if isinstance(spec, Loader):
        return DatasetSource(spec, seed, pin_memory)
    return TensorSource(spec, supports_float64)


def known_length(spec: Arrays | Loader) -> int | None:
    """Samples in the data when the driver knows it without building anything (None: built on workers)."""
    if isinstance(spec, Loader):
        return None if spec.built_on_workers else len(spec.dataset)
    return len(spec[0])


def _digest(batch: Any, digest: Any) -> None:
    """Feed a batch's structure and values into `digest` (tensors by dtype, shape and bytes)."""
    if isinstance(batch, torch.Tensor):
        t = batch.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(batch, Mapping):
        for k in sorted(batch, key=str):
            digest.update(str(k).encode())
            _digest(batch[k], digest)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            _digest(v, digest)
    else:
        digest.update(repr(batch).encode())

"""Refit through shared memory: on a one-node CPU cluster the policy writes its weights into a file in
``/dev/shm`` that the generation workers map once; each refit then costs one copy on each side and no
serialisation (the object-store path, :mod:`nemo_like.models.refit.buckets`, pickles every bucket
into Ray's store and out again).

Lifetime of the file: the policy's rank 0 creates it at its first export (or when the facade asks for a
fresh one) and writes every later export into it in place; it stays linked until the writer closes it or
replaces it (a new layout), so an engine that starts mid-run (a replacement for a dead one) can map it and
load the weights its group serves: the buffer holds exactly the last refit's weights until the next refit
writes it. A killed run leaves at most one file behind, named after the writer's pid
(``nemo_like_refit_<pid>p<pid namespace>_<n>``); the next writer on the machine removes it.

Every buffer starts with a header holding the version of the weights in it, written after the tensors; a
receiver checks it against its descriptor's version, so an engine can never load weights newer (or older)
than the refit it was sent.

Writes never overlap reads: the policy writes only inside an export, which the driver starts after the
previous refit call returned, and a receiver copies the tensors into its model before its refit call returns.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nemo_like.models.refit.buckets import WeightBuckets
from nemo_like.utils.orphans import process_tag
from nemo_like.utils.orphans import remove_orphans as remove_orphan_paths

SHM_DIR = Path("/dev/shm")
ALIGN = 64  # bytes: every tensor starts on a cache line, so a byte view can be reinterpreted as any dtype
HEADER = ALIGN  # bytes before the first tensor: the int64 version of the weights in the buffer
WRITING = -1  # the header's version while the writer overwrites the tensors
_counter = itertools.count()
_mapped: dict[str, torch.Tensor] = {}  # receiver side: buffer path -> its mapping (only the newest is kept)


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in the buffer."""

    name: str
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class SharedWeights(WeightBuckets):
    """A refit descriptor (same interface as :class:`WeightBuckets`): the version, the buffer's path and size,
    and where each tensor lies in it. Tiny: only this travels through Ray."""

    path: str = ""
    size: int = 0
    entries: list[Entry] = field(default_factory=list)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views of the mapped buffer (valid until the next refit writes it: copy them). Raises
        :class:`StaleRefitBuffer` when the buffer holds another version than this descriptor's."""
        buffer = map_buffer(self.path, self.size)
        held = buffer_version(buffer)
        if held != self.version:
            raise StaleRefitBuffer(
                f"shared refit buffer {self.path} holds weight version {held}, but this refit is version {self.version}: "
                "the policy wrote another refit into it since"
            )
        for e in self.entries:
            yield e.name, buffer[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)

    def iter_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """One bucket: every tensor (they are views, nothing is copied)."""
        yield dict(self.iter_tensors())

    def check_intact(self) -> None:
        """After a receiver copied the views: raise :class:`StaleRefitBuffer` unless the buffer still holds this
        version (the writer stamps the header ``WRITING`` before it overwrites a tensor, so a copy that overlapped a
        newer export, e.g. a replacement engine loading while an async run refits, is caught, not served)."""
        held = buffer_version(map_buffer(self.path, self.size))
        if held != self.version:
            raise StaleRefitBuffer(
                f"shared refit buffer {self.path} was rewritten (it holds {'a write in progress' if held == WRITING else f'version {held}'}) "
                f"while weight version {self.version} was read from it: the copy may mix two versions"
            )


class StaleRefitBuffer(RuntimeError):
    """A shared refit buffer no longer holds the version its descriptor names."""


def buffer_version(buffer: torch.Tensor) -> int:
    """The weight version stamped in a buffer's header."""
    return int(buffer[:8].view(torch.int64)[0])


def map_buffer(path: str, size: int) -> torch.Tensor:
    """The receiver's ``uint8`` mapping of ``path`` (mapped once; older buffers are dropped)."""
    buffer = _mapped.get(path)
    if buffer is None:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"shared refit buffer {path} is gone: the policy replaced it (a new layout) or the run ended, so this "
                "descriptor cannot be loaded (the policy must export again)"
            )
        _mapped.clear()
        buffer = _mapped[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    return buffer


def forget_mappings() -> None:
    """Drop the receiver's mapping of a refit buffer: an engine kept for the next run (``reuse_actors``) would otherwise
    hold the last run's buffer, a whole model's worth of ``/dev/shm`` that ``ls`` no longer shows once the policy
    unlinked it, until its next refit."""
    _mapped.clear()


class SharedMemoryFull(RuntimeError):
    """``/dev/shm`` cannot hold the refit buffer (Docker's default is 64 MB)."""


@dataclass(frozen=True)
class SharedMemoryRefused:
    """What a policy rank returns instead of :class:`SharedWeights` when ``/dev/shm`` has no room: the policy then
    refits through the object store (``reason`` says why)."""

    reason: str


def reserve(path: str, size: int) -> None:
    """Create ``path`` with ``size`` bytes allocated up front. A tmpfs file is sparse: without the reservation a full
    ``/dev/shm`` shows only when a page is first written, as a SIGBUS that kills the process. Raises
    :class:`SharedMemoryFull` (and leaves no file) when the space is not there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.unlink(path)
        free = shutil.disk_usage(SHM_DIR).free
        raise SharedMemoryFull(
            f"{SHM_DIR} cannot hold the {size / 2**20:.1f} MiB refit buffer ({exc.strerror}; {free / 2**20:.1f} MiB free); "
            "enlarge it (Docker: --shm-size)",
        ) from None
    finally:
        os.close(fd)


def shared_memory_available() -> bool:
    """Whether ``/dev/shm`` exists and is writable (Linux)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedWeightWriter:
    """The policy side: owns the buffer file and writes each version of the weights into it."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.buffer: torch.Tensor | None = None
        self.entries: list[Entry] = []
        self.linked = False

    def write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], fresh: bool = False) -> SharedWeights:
        """Copy ``tensors`` into the buffer (a new file when ``fresh``, on the first call, or when the layout
        changed); returns the descriptor for the receivers."""
        tensors = list(tensors)
        entries = layout(tensors)
        if fresh or self.buffer is None or entries != self.entries:
            self._create(entries)
        with torch.no_grad():
            self.buffer[:8].view(torch.int64)[0] = WRITING  # first: a reader never takes half-written contents for a version
            for (_, t), e in zip(tensors, self.entries):
                self.buffer[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t)
            self.buffer[:8].view(torch.int64)[0] = version  # last: the stamp names complete contents
        names = [e.name for e in self.entries]
        nbytes = sum({e.offset: e.nbytes for e in self.entries}.values())  # tied weights: written and counted once
        return SharedWeights(version, [names], [], nbytes=nbytes, path=self.path, size=self.buffer.numel(), entries=list(self.entries))

    def _create(self, entries: list[Entry]) -> None:
        self.unlink()
        remove_orphans()
        size = max((e.offset + e.nbytes for e in entries), default=HEADER)  # the last entry may be a tied one, placed earlier
        path = str(SHM_DIR / f"nemo_like_refit_{process_tag()}_{next(_counter)}")
        reserve(path, size)
        self.path = path
        self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self.entries = entries
        self.linked = True

    def unlink(self) -> None:
        """Remove the file name (existing mappings stay valid)."""
        if self.linked and self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.linked = False

    def close(self) -> None:
        """Unlink the file and drop this side's mapping."""
        self.unlink()
        self.buffer = None
        self.entries = []


def remove_orphans() -> list[str]:
    """Unlink the buffers of writers that no longer run (a killed run's); returns their paths."""
    return remove_orphan_paths(SHM_DIR.glob("nemo_like_refit_*_*"), "nemo_like_refit_", lambda path: path.unlink(missing_ok=True))


def layout(tensors: list[tuple[str, torch.Tensor]]) -> list[Entry]:
    """Offsets (``ALIGN``-aligned) of ``tensors`` packed one after the other, after the ``HEADER``; a tensor listed
    again under another name (tied weights) points at its first place."""
    entries, offset, placed = [], HEADER, {}
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        where = placed.setdefault(id(t), offset)
        entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), where, nbytes))
        if where == offset:
            offset += -(-nbytes // ALIGN) * ALIGN
    return entries

"""Shared-memory snapshot slots: the file format a node agent owns and ranks write into.

A slot is one file (normally in ``/dev/shm``)::

    [header page, 4096 B][data region, capacity D][meta region, capacity M]

The agent creates it (``create_slot_file``); a rank maps it (``MappedSlot.open``), asks
for writable tensor views of the data region (``begin_write``), copies its snapshot
straight into them (the one copy from the model) and seals it with ``finish_write``,
which stores every other leaf and the tree's structure in the meta region as JSON plus a
binary tail (never pickle). Because the mapping is MAP_SHARED, what the rank wrote
survives the rank's death.

Invariants:
- ``begin_write`` stores state WRITING (and seq + 1) before anything else changes;
  ``finish_write`` stores state COMPLETE after meta, sizes and checksums. Stores to a shared
  mapping become visible in program order on x86 (TSO), and all of a killed process's
  stores are visible once it is dead, so a slot reads COMPLETE only if its copy finished.
- ``read`` returns only a COMPLETE slot whose data and meta checksums match. Each leaf in
  the data region has its own crc32 (in its meta record), computed by the rank right after
  its copy; the agent hands these to the store, so a checkpoint's checksums are the rank's
  and bytes that changed in RAM before the persist fail the load instead of being stored
  as good. The header's ``data_crc32`` is the crc32 of those leaf checksums (replicas of
  one snapshot on two nodes have equal ones).
- Views handed out by ``begin_write`` and ``read(copy=False)`` point into the mapping and
  are valid only while it is mapped: drop them before ``close``. ``close`` never unmaps
  under live views (they hold a buffer export; the mapping then goes with the last one).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq.errors import LocatedError
from ray_checkfreq.storage.arrays import LeafSpec, leaf_bytes, leaf_from_buffer, leaf_spec, torch_dtype
from ray_checkfreq.storage.backends.direct import BLOCK, LARGE_LEAF_BYTES, leaf_start
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.tree import KeyPath, SkeletonError, flatten_state, unflatten_state

SLOT_EMPTY, SLOT_WRITING, SLOT_COMPLETE = 0, 1, 2
_STATE_NAMES = {SLOT_EMPTY: "EMPTY", SLOT_WRITING: "WRITING", SLOT_COMPLETE: "COMPLETE"}

MAGIC = b"RCFSLOT1"
FORMAT_VERSION = 2  # 2: a crc32 per data leaf (1: one over the data region)
HEADER_BYTES = 4096
NAME_BYTES = 64
ALIGN = 64
META_FORMAT = 1

# magic, version, state, seq, step, generation, layout hash, creator pid, creator start,
# data bytes, meta bytes, data crc32, data capacity, meta capacity, run, node, incarnation
_HEADER = struct.Struct("<8sIIQqq16sIQQQIQQ64s64sI")
_STATE_OFFSET = 12
_STATE = struct.Struct("<I")
_META_PREFIX = struct.Struct("<IQ")  # crc32 of what follows, length of the JSON


class SlotError(LocatedError, ValueError):
    """A slot file that cannot be used: ``"<path>: <what is wrong>"``."""


@dataclass(frozen=True)
class SlotHeader:
    run: str
    node: str
    incarnation: int
    state: int
    seq: int
    step: int
    generation: int
    layout_hash: str
    creator_pid: int
    creator_start: int
    data_bytes: int
    meta_bytes: int
    data_crc32: int
    data_capacity: int
    meta_capacity: int

    @property
    def state_name(self) -> str:
        return _STATE_NAMES.get(self.state, str(self.state))


@dataclass(frozen=True)
class SlotLayout:
    """Where each tensor of a snapshot lives in the data region: key path -> (offset, shape, dtype)."""

    entries: dict[KeyPath, tuple[int, tuple[int, ...], torch.dtype]]
    data_bytes: int
    hash: str


# ------------------------------------------------------------------ layout
def slot_layout(tensors: Sequence[tuple[KeyPath, Sequence[int], torch.dtype]]) -> SlotLayout:
    """Offsets in the given order, aligned to 64 bytes, large leaves to a block (so an agent
    writes them from the slot around the page cache); the hash covers paths, shapes, dtypes
    and that alignment rule."""
    entries: dict[KeyPath, tuple[int, tuple[int, ...], torch.dtype]] = {}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"rcf-slot-layout/{FORMAT_VERSION}/{BLOCK}:{LARGE_LEAF_BYTES}".encode())
    end = 0
    for path, shape, dtype in tensors:
        dims = _checked_shape(path, shape)
        if path in entries:
            raise ValueError(f"key path {path!r} appears twice in the slot layout")
        nbytes = _numel(dims) * dtype.itemsize
        offset = leaf_start(end, nbytes, ALIGN)
        entries[path] = (offset, dims, dtype)
        end = offset + nbytes
        digest.update(repr((tuple(path), dims, str(dtype))).encode() + b"\0")
    return SlotLayout(entries=entries, data_bytes=end, hash=digest.hexdigest())


def _checked_shape(path: KeyPath, shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"key path {path!r}: negative dimension in shape {dims}")
    return dims


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _aligned(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def meta_capacity_for(layout: SlotLayout) -> int:
    """Room for the tree's structure and its small leaves: 1 MiB + 4 KiB per tensor."""
    return (1 << 20) + 4096 * len(layout.entries)


def data_capacity_for(layout: SlotLayout) -> int:
    """The layout's data bytes rounded up to whole pages."""
    return _aligned(layout.data_bytes, mmap.PAGESIZE)


def slot_file_bytes(layout: SlotLayout) -> int:
    """Total size of a slot file made for ``layout`` (header + data + meta)."""
    return HEADER_BYTES + data_capacity_for(layout) + meta_capacity_for(layout)


# ------------------------------------------------------------------ header
def _encode_name(value: str, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > NAME_BYTES or b"\0" in raw:
        raise ValueError(f"{what} {value!r} must be at most {NAME_BYTES} UTF-8 bytes without NUL")
    return raw


def _pack_header(header: SlotHeader) -> bytes:
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, header.state, header.seq, header.step, header.generation,
        bytes.fromhex(header.layout_hash), header.creator_pid, header.creator_start,
        header.data_bytes, header.meta_bytes, header.data_crc32, header.data_capacity,
        header.meta_capacity, _encode_name(header.run, "run id"), _encode_name(header.node, "node id"),
        header.incarnation,
    )


def _parse_header(raw: bytes, path: str) -> SlotHeader:
    if len(raw) < _HEADER.size:
        raise SlotError(path, f"truncated: {len(raw)} bytes, a slot header needs {HEADER_BYTES}")
    (magic, version, state, seq, step, generation, layout_hash, pid, start, data_bytes, meta_bytes,
     data_crc, data_capacity, meta_capacity, run, node, incarnation) = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise SlotError(path, f"not a slot file (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise SlotError(path, f"slot format version {version} is not supported (expected {FORMAT_VERSION})")
    if state not in _STATE_NAMES:
        raise SlotError(path, f"bad slot state {state}")
    return SlotHeader(
        run=_decode_name(run, path), node=_decode_name(node, path), incarnation=incarnation,
        state=state, seq=seq, step=step, generation=generation, layout_hash=layout_hash.hex(),
        creator_pid=pid, creator_start=start, data_bytes=data_bytes, meta_bytes=meta_bytes,
        data_crc32=data_crc, data_capacity=data_capacity, meta_capacity=meta_capacity,
    )


def _decode_name(raw: bytes, path: str) -> str:
    try:
        return raw.rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError:
        raise SlotError(path, "run or node id in the header is not UTF-8") from None


# ------------------------------------------------------------------ processes and files
def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot); None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()  # the command name may hold spaces and ")"
    try:
        return int(fields[19])  # fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def shm_free_bytes(directory: str = "/dev/shm") -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def create_slot_file(path: str, *, run: str, node: str, incarnation: int, data_capacity: int,
                     meta_capacity: int) -> None:
    """Create an EMPTY slot owned by this process; fails if ``path`` exists.

    Space is reserved with ``posix_fallocate`` (so a full tmpfs fails here, not with SIGBUS
    during a copy; where unsupported, ``ftruncate`` without that guarantee) and every page
    is touched once.
    """
    if data_capacity < 0 or meta_capacity < _META_PREFIX.size:
        raise ValueError(f"bad slot capacities: data {data_capacity}, meta {meta_capacity}")
    pid = os.getpid()
    header = SlotHeader(
        run=run, node=node, incarnation=incarnation, state=SLOT_EMPTY, seq=0, step=-1, generation=-1,
        layout_hash="00" * 16, creator_pid=pid, creator_start=process_start_time(pid) or 0,
        data_bytes=0, meta_bytes=0, data_crc32=0, data_capacity=data_capacity, meta_capacity=meta_capacity,
    )
    packed = _pack_header(header)  # raises ValueError for bad names before the file exists
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, HEADER_BYTES + data_capacity + meta_capacity)
        os.pwrite(fd, packed, 0)
        _touch_pages(fd, HEADER_BYTES + data_capacity + meta_capacity)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # the filesystem cannot
            raise
        os.ftruncate(fd, size)


def _touch_pages(fd: int, size: int) -> None:
    with mmap.mmap(fd, size) as mapping:
        pages = np.frombuffer(mapping, dtype=np.uint8)
        pages[HEADER_BYTES::mmap.PAGESIZE] = 0  # fresh pages are zero: this only faults them in
        del pages


def sweep_leftovers(directory: str = "/dev/shm", prefix: str = "rcf-") -> list[str]:
    """Remove slot files under ``directory`` whose creator process is gone; returns their paths.

    A file is removed only if its name starts with ``prefix``, it parses as a slot file, and
    its creator pid is not running or now belongs to a process started at another time.
    """
    if not os.path.isdir("/proc/self"):
        return []  # no way to prove a creator dead
    removed = []
    for entry in os.scandir(directory):
        if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False) and _orphaned(entry.path):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(entry.path)
    return removed


def _orphaned(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            header = _parse_header(file.read(HEADER_BYTES), path)
    except (OSError, SlotError):
        return False
    return process_start_time(header.creator_pid) != header.creator_start


# ------------------------------------------------------------------ the mapped slot
class MappedSlot:
    """A slot file mapped read/write (MAP_SHARED) into this process."""

    def __init__(self, path: str, mapping: mmap.mmap) -> None:
        self.path = path
        self._mapping: mmap.mmap | None = mapping
        self._pinned = False
        base = np.frombuffer(mapping, dtype=np.uint8, count=1)
        self._data_address = base.ctypes.data + HEADER_BYTES
        del base

    @classmethod
    def open(cls, path: str) -> MappedSlot:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            header = _parse_header(os.pread(fd, HEADER_BYTES, 0), path)
            expected = HEADER_BYTES + header.data_capacity + header.meta_capacity
            if size != expected:
                raise SlotError(path, f"file has {size} bytes, its header says {expected} (truncated?)")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mapping)

    def header(self) -> SlotHeader:
        return _parse_header(self._mm[:_HEADER.size], self.path)

    def fits(self, layout: SlotLayout) -> bool:
        return self.header().data_capacity >= layout.data_bytes

    def begin_write(self, *, step: int, generation: int, layout: SlotLayout) -> dict[KeyPath, torch.Tensor]:
        """Mark the slot WRITING (seq + 1) and return a writable view per key path of ``layout``."""
        old = self.header()
        if old.data_capacity < layout.data_bytes:
            raise SlotError(self.path, f"layout needs {layout.data_bytes} data bytes, "
                                       f"the slot holds {old.data_capacity}")
        self._set_state(SLOT_WRITING)
        self._write_header(SlotHeader(
            run=old.run, node=old.node, incarnation=old.incarnation, state=SLOT_WRITING, seq=old.seq + 1,
            step=step, generation=generation, layout_hash=layout.hash, creator_pid=old.creator_pid,
            creator_start=old.creator_start, data_bytes=layout.data_bytes, meta_bytes=0, data_crc32=0,
            data_capacity=old.data_capacity, meta_capacity=old.meta_capacity,
        ))
        return {path: self._view(HEADER_BYTES + offset, shape, dtype)
                for path, (offset, shape, dtype) in layout.entries.items()}

    def finish_write(self, state: Mapping[str, Any]) -> SlotHeader:
        """Store ``state``'s structure and its leaves outside the data region, then mark it COMPLETE.

        Tensor leaves that are contiguous views of this slot's used data region are
        recorded by offset; all others are copied into the meta region.
        """
        header = self.header()
        if header.state != SLOT_WRITING:
            raise SlotError(self.path, f"finish_write on a slot in state {header.state_name} (begin_write first)")
        meta, leaf_crcs = self._encode_meta(state, header.data_bytes)
        if len(meta) > header.meta_capacity:
            raise SlotError(self.path, f"meta needs {len(meta)} bytes, the slot holds {header.meta_capacity}")
        meta_start = HEADER_BYTES + header.data_capacity
        self._mm[meta_start:meta_start + len(meta)] = meta
        sealed = _replace(header, meta_bytes=len(meta), data_crc32=_digest(leaf_crcs))
        self._write_header(sealed)
        self._set_state(SLOT_COMPLETE)
        return _replace(sealed, state=SLOT_COMPLETE)

    def read(self, *, copy: bool = False, verify_data: bool = True) -> tuple[SlotHeader, Any]:
        """The header and state of a COMPLETE slot whose checksums match; SlotError otherwise.
        (``read_with_checksums`` for the arguments.)"""
        header, state, _ = self.read_with_checksums(copy=copy, verify_data=verify_data)
        return header, state

    def read_with_checksums(self, *, copy: bool = False,
                            verify_data: bool = True) -> tuple[SlotHeader, Any, list[int | None]]:
        """The header, the state and its leaves' crc32 in ``flatten_state`` order (None for a
        leaf kept in the meta region) of a COMPLETE slot whose checksums match.

        ``copy=False``: tensors stored by offset are views of the mapping (drop them before
        ``close``). ``copy=True``: private copies, and the slot must not be rewritten meanwhile.
        ``verify_data=False`` skips the data leaves' checksums (the header and meta are still
        checked): for a persist, which stores them with the leaves so that the load checks
        them; a restore always verifies.
        """
        header = self._readable_header()
        if copy:
            data: Any = torch.empty(header.data_bytes, dtype=torch.uint8).numpy()
            data[:] = np.frombuffer(self._mm, dtype=np.uint8, count=header.data_bytes, offset=HEADER_BYTES)
            data_offset = 0
        else:
            data, data_offset = self._mm, HEADER_BYTES
        meta_start = HEADER_BYTES + header.data_capacity
        state, leaves, leaf_crcs = self._decode_meta(self._mm[meta_start:meta_start + header.meta_bytes], data,
                                                     data_offset, header.data_bytes)
        if _digest(leaf_crcs) != header.data_crc32:
            raise SlotError(self.path, "data crc32 mismatch: the header does not match the leaves' checksums")
        if verify_data:
            self._verify_leaves(leaves, leaf_crcs)
        if copy and self.header() != header:
            raise SlotError(self.path, "slot was rewritten while it was being read")
        return header, state, leaf_crcs

    def regions(self) -> tuple[SlotHeader, bytes, np.ndarray]:
        """A COMPLETE slot as a peer copy travels: its header, its meta region (a copy: it is
        small) and its used data region (a view of the mapping: drop it before ``close``).
        ``decode_copy`` reads them back; nothing is checked here."""
        header = self._readable_header()
        meta_start = HEADER_BYTES + header.data_capacity
        data = np.frombuffer(self._mm, dtype=np.uint8, count=header.data_bytes, offset=HEADER_BYTES)
        return header, bytes(self._mm[meta_start:meta_start + header.meta_bytes]), data

    def _verify_leaves(self, leaves: list[Any], leaf_crcs: list[int | None]) -> None:
        for index, (leaf, expected) in enumerate(zip(leaves, leaf_crcs)):
            if expected is not None and crc32(leaf_bytes(leaf)) != expected:
                raise SlotError(self.path, f"data crc32 mismatch in leaf #{index}: the slot's data is corrupt")

    def close(self) -> None:
        """Unmap now, or, while views are alive, when the last of them goes."""
        if self._pinned and self._mapping is not None:
            unregister_pinned(self)
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # views still export the mapping: it is unmapped when they are freed

    def __enter__(self) -> MappedSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals
    @property
    def _mm(self) -> mmap.mmap:
        if self._mapping is None:
            raise SlotError(self.path, "slot is closed")
        return self._mapping

    def _set_state(self, state: int) -> None:
        _STATE.pack_into(self._mm, _STATE_OFFSET, state)

    def _write_header(self, header: SlotHeader) -> None:
        self._mm[:_HEADER.size] = _pack_header(header)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _tensor_at(self._mm, offset, _numel(shape) * dtype.itemsize, dtype, shape)

    def _readable_header(self) -> SlotHeader:
        header = self.header()
        if header.state != SLOT_COMPLETE:
            raise SlotError(self.path, f"torn or unused slot: state {header.state_name}, not COMPLETE")
        if header.data_bytes > header.data_capacity or not _META_PREFIX.size <= header.meta_bytes \
                <= header.meta_capacity:
            raise SlotError(self.path, f"header sizes out of range: data {header.data_bytes}/"
                                       f"{header.data_capacity}, meta {header.meta_bytes}/{header.meta_capacity}")
        return header

    def _in_data_region(self, tensor: torch.Tensor, used: int) -> int | None:
        """The offset of ``tensor`` in the used data region, if it is a plain view of it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            return None
        nbytes = tensor.numel() * tensor.element_size()
        offset = tensor.data_ptr() - self._data_address
        if nbytes == 0 or offset < 0 or offset + nbytes > used or offset % tensor.element_size():
            return None
        return offset

    def _encode_meta(self, state: Mapping[str, Any], used: int) -> tuple[bytes, list[int | None]]:
        flat = flatten_state(state)
        records, tail = [], bytearray()
        leaf_crcs: list[int | None] = []
        for leaf in flat.leaves:
            spec = leaf_spec(leaf)
            record: dict[str, Any] = {"kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape)}
            offset = self._in_data_region(leaf, used) if isinstance(leaf, torch.Tensor) else None
            if offset is None:
                tail.extend(bytes(_aligned(len(tail), ALIGN) - len(tail)))
                record.update(where="meta", offset=len(tail))
                tail.extend(leaf_bytes(leaf))
                leaf_crcs.append(None)  # under the meta region's checksum
            else:
                record.update(where="data", offset=offset, crc32=crc32(leaf_bytes(leaf)))
                leaf_crcs.append(record["crc32"])
            records.append(record)
        text = json.dumps({"format": META_FORMAT, "skeleton": flat.skeleton, "leaves": records},
                          separators=(",", ":")).encode()
        body = text + bytes(_aligned(_META_PREFIX.size + len(text), ALIGN) - _META_PREFIX.size - len(text)) + tail
        return _META_PREFIX.pack(crc32(body), len(text)) + body, leaf_crcs

    def _decode_meta(self, meta: bytes, data: Any, data_offset: int,
                     used: int) -> tuple[Any, list[Any], list[int | None]]:
        try:
            return _parse_meta(meta, data, data_offset, used)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, SkeletonError) as error:
            raise SlotError(self.path, f"bad meta region: {error}") from None


def decode_copy(meta: bytes, data: Any, where: str) -> tuple[Any, list[int | None]]:
    """The state of a slot's regions as ``MappedSlot.regions`` gave them (``data``: the used
    data region, any buffer; the tensors are views of it) and its leaves' checksums from the
    meta region; SlotError naming ``where`` for a bad meta region. The data leaves are not
    checked here (``shard_copies.verified`` does, against the rank's checksums)."""
    try:
        state, _, leaf_crcs = _parse_meta(meta, data, 0, len(data))
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, SkeletonError) as error:
        raise SlotError(where, f"bad meta region: {error}") from None
    return state, leaf_crcs


def _replace(header: SlotHeader, **changes: Any) -> SlotHeader:
    return SlotHeader(**{**header.__dict__, **changes})


def _tensor_at(buffer: Any, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # through numpy: its buffer export keeps the mapping alive (torch.frombuffer's does not)
    raw = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset))
    return raw.view(dtype).reshape(shape)


def _digest(leaf_crcs: list[int | None]) -> int:
    """One checksum of the data region: the crc32 of its leaves' checksums."""
    known = [crc for crc in leaf_crcs if crc is not None]
    return crc32(struct.pack(f"<{len(known)}I", *known))


def _parse_meta(meta: bytes, data: Any, data_offset: int, used: int) -> tuple[Any, list[Any], list[int | None]]:
    """The state, its leaves in ``flatten_state`` order and their checksums."""
    checksum, text_bytes = _META_PREFIX.unpack_from(meta)
    body = memoryview(meta)[_META_PREFIX.size:]
    if crc32(body) != checksum:
        raise ValueError("meta crc32 mismatch: the slot's meta region is corrupt")
    document = json.loads(bytes(body[:text_bytes]))
    if not isinstance(document, dict) or document.get("format") != META_FORMAT:
        raise ValueError("unknown meta format")
    tail = body[_aligned(_META_PREFIX.size + text_bytes, ALIGN) - _META_PREFIX.size:]
    records = document["leaves"]
    leaves = [_decode_leaf(record, data, data_offset, used, tail) for record in records]
    leaf_crcs = [int(record["crc32"]) if record["where"] == "data" else None for record in records]
    return unflatten_state(document["skeleton"], leaves), leaves, leaf_crcs


def _decode_leaf(record: dict, data: Any, data_offset: int, used: int, tail: memoryview) -> Any:
    spec = LeafSpec(kind=record["kind"], dtype=record["dtype"], shape=tuple(int(d) for d in record["shape"]))
    offset, nbytes = int(record["offset"]), spec.nbytes
    if any(d < 0 for d in spec.shape) or offset < 0:
        raise ValueError(f"bad leaf record {record!r:.120}")
    if record["where"] == "data":
        if spec.kind != "torch" or offset + nbytes > used:
            raise ValueError(f"data leaf {record!r:.120} lies outside the used data region")
        return _tensor_at(data, data_offset + offset, nbytes, torch_dtype(spec.dtype), spec.shape)
    if record["where"] != "meta" or offset + nbytes > len(tail):
        raise ValueError(f"meta leaf {record!r:.120} lies outside the meta region")
    private = bytearray(tail[offset:offset + nbytes])
    if spec.kind == "torch":
        return _tensor_at(private, 0, nbytes, torch_dtype(spec.dtype), spec.shape)
    return leaf_from_buffer(spec, private, 0)


# ------------------------------------------------------------------ GPU pinning
def register_pinned(target: torch.Tensor | MappedSlot) -> bool:
    """Page-lock a whole slot mapping (or one host view) for fast device copies, in this
    process; False where there is no CUDA or the driver refused. ``MappedSlot.close``
    unregisters a registered slot before unmapping it."""
    address, nbytes = _span(target)
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    pinned = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)) == 0
    if pinned and isinstance(target, MappedSlot):
        target._pinned = True
    return pinned


def unregister_pinned(target: torch.Tensor | MappedSlot) -> None:
    """Undo ``register_pinned``; must run before the memory is unmapped."""
    address, nbytes = _span(target)
    if isinstance(target, MappedSlot):
        if not target._pinned:
            return
        target._pinned = False
    if torch.cuda.is_available() and nbytes > 0:
        torch.cuda.cudart().cudaHostUnregister(address)


def _span(target: torch.Tensor | MappedSlot) -> tuple[int, int]:
    if isinstance(target, MappedSlot):
        return target._data_address - HEADER_BYTES, len(target._mm)
    return target.data_ptr(), target.numel() * target.element_size()

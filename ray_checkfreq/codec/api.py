"""encode / decode / blob_info: the codec's public functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq.codec import blob as blobfmt
from ray_checkfreq.codec import dtypes, layout, nearlossless, pool, zstdparams
from ray_checkfreq.codec.errors import BaseMismatchError, CodecError, CorruptBlobError
from ray_checkfreq.codec.frames import FramePlan, check_stream_sizes, decode_frame, encode_frame


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """Layout knobs; the defaults are the measured ones."""

    frame_bytes: int = 1 << 20  # 256 KB, 1 MB and 4 MB frames measured within 0.1 % ratio
    small_bytes: int = 4096  # below this, one ungrouped stream: grouping cannot pay

    def __post_init__(self) -> None:
        if not isinstance(self.frame_bytes, int) or self.frame_bytes < 16 or self.frame_bytes % 16:
            raise CodecError(f"frame_bytes must be a multiple of 16, got {self.frame_bytes!r}")
        if not isinstance(self.small_bytes, int) or self.small_bytes < 0:
            raise CodecError(f"small_bytes must be >= 0, got {self.small_bytes!r}")


DEFAULT_CONFIG = CodecConfig()
# Decoded bytes per stored byte that decode accepts from a blob's own header when the
# caller does not say what size it expects (expected_nbytes=). An all-zero tensor encoded
# with the default frames expands about 15000x; a forged header can claim any size.
MAX_EXPANSION = 1 << 16


def _as_bytes(x: Any, what: str) -> tuple[np.ndarray, dtypes.DtypeInfo, tuple[int, ...]]:
    """A read-only flat uint8 view of ``x`` (a copy only if x is strided, on GPU or swapped)."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_quantized:
            raise CodecError(f"{what}: only dense tensors can be encoded, not {x.layout}")
        info = dtypes.from_torch(x.dtype)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        # contiguous() keeps odd strides on tensors of <= 1 element, which view() refuses;
        # as_strided is exact for any dense tensor.
        flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy() if t.numel() else (
            np.empty(0, np.uint8))
        shape = tuple(x.shape)
    elif isinstance(x, np.ndarray):
        info = dtypes.from_numpy(x.dtype)
        a = x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        shape = tuple(x.shape)
    else:
        raise CodecError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    flat = flat.view()
    flat.flags.writeable = False  # the codec never writes into caller memory
    return flat, info, shape


def encode(x: torch.Tensor | np.ndarray, *, base: torch.Tensor | np.ndarray | None = None,
           precision_bits: int | None = None, precision_factor: int | float | None = None,
           level: int | None = None, threads: int | None = None,
           config: CodecConfig | None = None) -> bytes:
    """Compress ``x`` into a self-describing blob; ``x`` is never modified.

    ``base``: the same tensor from an earlier checkpoint; the blob then stores the XOR
    delta (of the rounded values, in a near-lossless mode) and :func:`decode` needs the
    same base. Near-lossless, one or the other (bounds in
    :mod:`ray_checkfreq.codec.nearlossless`): ``precision_bits`` keeps that many mantissa
    bits (relative error); ``precision_factor`` B, a power of two, rounds to multiples of
    1/B (absolute error <= 1/(2B)) when every finite value lies in [-1, 1], else stores
    ``x`` exactly; :func:`blob_info` tells which.
    ``level``: a zstd level for every stream instead of the tuned per-stream settings.
    ``threads``: frames coded in parallel (None: all cores).
    """
    cfg = config or DEFAULT_CONFIG
    src, info, shape = _as_bytes(x, "x")
    base_bytes = None
    if base is not None:
        base_bytes, base_info, base_shape = _as_bytes(base, "base")
        if base_info != info or base_shape != shape:
            raise CodecError(f"base must match x: x is {info.name}{list(shape)}, "
                             f"base is {base_info.name}{list(base_shape)}")
    src, factor_log2, rounded = _round_by_factor(src, info, precision_bits, precision_factor)
    if precision_bits is not None:
        nearlossless.check_supported(info, precision_bits)
    zstdparams.check_level(level)
    workers = pool.resolve_threads(threads)
    plan = _plan(info, src.nbytes, cfg, level, precision_bits)
    results = pool.run_indexed(lambda i: encode_frame(plan, src, base_bytes, i),
                               plan.nframes, workers)
    flags = (blobfmt.FLAG_DELTA if base is not None else 0) | _LAYOUT_FLAGS[plan.layout.kind]
    flags |= blobfmt.FLAG_FACTOR_ROUNDED if rounded else 0
    header = blobfmt.Header(
        flags=flags, dtype=info.name, shape=shape, precision_bits=precision_bits,
        precision_factor_log2=factor_log2, width=plan.width, rotation=plan.layout.rotation,
        frame_elems=plan.frame_bytes // info.itemsize,
        frames=tuple(entry for entry, _ in results))
    return b"".join([blobfmt.pack(header), *(s for _, streams in results for s in streams)])


def _round_by_factor(src: np.ndarray, info: dtypes.DtypeInfo, precision_bits: int | None,
                     precision_factor: Any) -> tuple[np.ndarray, int | None, bool]:
    """(bytes to store, log2 of the factor or None, whether they were rounded)."""
    if precision_factor is None:
        return src, None, False
    if precision_bits is not None:
        raise CodecError(f"precision_bits={precision_bits!r} and precision_factor="
                         f"{precision_factor!r}: give one or the other, not both")
    factor_log2 = nearlossless.check_factor(info, precision_factor)
    rounded = nearlossless.round_to_factor(src, info, factor_log2)
    return (src, factor_log2, False) if rounded is None else (rounded, factor_log2, True)


def trim(x: torch.Tensor | np.ndarray, *, precision_bits: int | None = None,
         precision_factor: int | float | None = None) -> torch.Tensor | np.ndarray:
    """What ``decode(encode(x, precision_...=...))`` returns, without the compression: a
    new CPU tensor (or array) of x's dtype and shape; ``x`` is never modified."""
    src, info, shape = _as_bytes(x, "x")
    if precision_bits is None and precision_factor is None:
        raise CodecError("trim: give precision_bits or precision_factor")
    out, _, _ = _round_by_factor(src, info, precision_bits, precision_factor)
    if precision_bits is not None:
        nearlossless.check_supported(info, precision_bits)
        out = nearlossless.round_frame(src, info, precision_bits)
    out = np.array(out, dtype=np.uint8, copy=True)
    if isinstance(x, np.ndarray):
        return out.view(x.dtype.newbyteorder("=")).reshape(shape)
    if not out.size:
        return torch.empty(shape, dtype=info.torch_dtype)
    return torch.from_numpy(out).view(info.torch_dtype).reshape(shape)


def _plan(info: dtypes.DtypeInfo, nbytes: int, cfg: CodecConfig, level: int | None,
          precision_bits: int | None) -> FramePlan:
    grouped = nbytes >= cfg.small_bytes and info.unit_bytes > 1
    frame_bytes = max(info.itemsize, cfg.frame_bytes // info.itemsize * info.itemsize)
    if not grouped:
        lay = layout.Layout(kind=layout.SINGLE, unit=info.unit_bytes)
    elif info.layout == layout.E8:
        lay = layout.Layout(kind=layout.E8, unit=info.unit_bytes)
    else:
        lay = layout.Layout(kind=layout.BYTES, unit=info.unit_bytes, rotation=info.rotation)
    return FramePlan(info=info, layout=lay, frame_bytes=frame_bytes, nbytes=nbytes,
                     level=level, precision_bits=precision_bits)


_LAYOUT_FLAGS = {layout.SINGLE: 0, layout.BYTES: blobfmt.FLAG_GROUPED,
                 layout.E8: blobfmt.FLAG_PLANAR_E8}


def _layout_from_header(h: blobfmt.Header, info: dtypes.DtypeInfo) -> layout.Layout:
    grouped, planar_e8 = h.flags & blobfmt.FLAG_GROUPED, h.flags & blobfmt.FLAG_PLANAR_E8
    sign_rotated = h.flags & blobfmt.FLAG_ROTATE
    unit = info.unit_bytes
    if planar_e8 and not grouped and not sign_rotated and h.version >= 3 and h.rotation == 0 \
            and info.exponent_bits == 8 and unit in (2, 4):
        return layout.Layout(kind=layout.E8, unit=unit)
    if grouped and not planar_e8 and unit > 1:
        if sign_rotated and h.version < 3 and h.rotation == 0:
            return layout.Layout(kind=layout.SIGN_ROTATED, unit=unit)
        if not sign_rotated and h.rotation < 8 * unit:
            return layout.Layout(kind=layout.BYTES, unit=unit, rotation=h.rotation)
    if not (grouped or planar_e8 or sign_rotated or h.rotation):
        return layout.Layout(kind=layout.SINGLE, unit=unit)
    raise CorruptBlobError("codec blob header names a layout that does not fit its dtype")


def _plan_from_header(h: blobfmt.Header, info: dtypes.DtypeInfo) -> FramePlan:
    nbytes = info.itemsize
    for dim in h.shape:
        nbytes *= dim
    frame_bytes = h.frame_elems * info.itemsize
    lay = _layout_from_header(h, info)
    if (h.width != lay.nstreams or frame_bytes <= 0 or frame_bytes % info.itemsize
            or len(h.frames) != -(-nbytes // frame_bytes)):
        raise CorruptBlobError("codec blob header is inconsistent with its dtype and shape")
    return FramePlan(info=info, layout=lay, frame_bytes=frame_bytes, nbytes=nbytes,
                     level=None, precision_bits=h.precision_bits)


def _prepare(blob, base, expected_nbytes: int | None, *, bounded: bool = True):
    """Header, payload start, dtype, plan and base bytes of a blob about to be decoded;
    refuses a declared size other than ``expected_nbytes`` (or, without it and when
    ``bounded``, past ``MAX_EXPANSION``) before anything that size is allocated."""
    header, start = blobfmt.unpack(blob)
    info = dtypes.from_name(header.dtype)
    plan = _plan_from_header(header, info)
    stored = memoryview(blob).nbytes
    if expected_nbytes is not None and plan.nbytes != expected_nbytes:
        raise CorruptBlobError(f"codec blob declares {info.name}{list(header.shape)} ({plan.nbytes} bytes), "
                               f"the caller expects {expected_nbytes} bytes")
    if expected_nbytes is None and bounded and plan.nbytes > max(stored, 1) * MAX_EXPANSION:
        raise CorruptBlobError(f"codec blob of {stored} bytes declares {plan.nbytes} decoded bytes, more than "
                               f"the {MAX_EXPANSION}x expansion decode accepts unless given expected_nbytes=")
    check_stream_sizes(plan, header.frames, memoryview(blob).cast("B"), start, header.version)
    base_bytes = None
    if header.is_delta:
        if base is None:
            raise BaseMismatchError("this codec blob is a delta: decode needs base=, the "
                                    "tensor it was encoded against")
        base_bytes, base_info, base_shape = _as_bytes(base, "base")
        if base_info != info or base_shape != header.shape:
            raise BaseMismatchError(
                f"wrong base for this delta blob: it was encoded against a "
                f"{info.name}{list(header.shape)} tensor, base is "
                f"{base_info.name}{list(base_shape)}")
    elif base is not None:
        raise CodecError("this codec blob is not a delta; call decode without base=")
    return header, start, info, plan, base_bytes


def decode(blob: bytes | bytearray | memoryview, *,
           base: torch.Tensor | np.ndarray | None = None,
           threads: int | None = None, expected_nbytes: int | None = None) -> torch.Tensor:
    """The tensor stored in ``blob``: contiguous, on CPU, bit-identical to what was encoded.

    Raises :class:`CorruptBlobError` for a damaged blob and :class:`BaseMismatchError`
    for a delta blob given no base or another base than the one it was encoded with.
    ``expected_nbytes``: the decoded size the caller knows (from a manifest, say); a blob
    declaring another is refused before any allocation. Without it a blob may declare at
    most ``MAX_EXPANSION`` times its own length.
    """
    header, start, info, plan, base_bytes = _prepare(blob, base, expected_nbytes)
    # numpy backs large arrays with transparent huge pages (madvise); a torch.empty of the
    # same size takes a page fault per 4 KB on first write, measured 4x slower to fill.
    if plan.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8).view(info.torch_dtype).reshape(header.shape)
    out_np = np.empty(plan.nbytes, np.uint8)
    _decode_frames(blob, header, start, plan, out_np, base_bytes, threads)
    return torch.from_numpy(out_np).view(info.torch_dtype).reshape(header.shape)


def decode_into(blob: bytes | bytearray | memoryview, out: torch.Tensor | np.ndarray, *,
                base: torch.Tensor | np.ndarray | None = None,
                threads: int | None = None) -> torch.Tensor | np.ndarray:
    """Decode into ``out``, a contiguous CPU tensor or array of the blob's dtype and shape
    (or of its byte size, any 1-byte dtype); returns ``out``.

    Reusing one buffer for successive restores skips the page faults of fresh memory (the
    first write to a new page costs about as much as copying it). ``out`` may hold partly
    written data if an error is raised. ``out`` must not overlap ``blob`` or ``base``.
    """
    header, start, info, plan, base_bytes = _prepare(blob, base, None, bounded=False)  # out bounds it
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous() or out.layout != torch.strided:
            raise CodecError("decode_into: out must be a contiguous CPU tensor")
        target = out.detach().reshape(-1).view(torch.uint8).numpy() if out.numel() else (
            np.empty(0, np.uint8))
        same = (out.dtype == info.torch_dtype and tuple(out.shape) == header.shape) or (
            out.element_size() == 1 and out.numel() == plan.nbytes)
    elif isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise CodecError("decode_into: out must be a writeable C-contiguous array")
        target = out.reshape(-1).view(np.uint8)
        same = (info.numpy_dtype is not None and out.dtype == info.numpy_dtype
                and out.shape == header.shape) or (out.itemsize == 1 and out.size == plan.nbytes)
    else:
        raise CodecError(f"decode_into: out must be a torch.Tensor or numpy.ndarray, "
                         f"got {type(out).__name__}")
    if not same or target.nbytes != plan.nbytes:
        raise CodecError(f"decode_into: out must be {info.name}{list(header.shape)} (or "
                         f"{plan.nbytes} bytes of a 1-byte dtype)")
    _decode_frames(blob, header, start, plan, target, base_bytes, threads)
    return out


def _decode_frames(blob, header: blobfmt.Header, start: int, plan: FramePlan,
                   out_np: np.ndarray, base_bytes: np.ndarray | None,
                   threads: int | None) -> None:
    payload = memoryview(blob).cast("B")
    offsets = [start]
    for entry in header.frames:
        offsets.append(offsets[-1] + entry.stored_len)
    pool.run_indexed(
        lambda i: decode_frame(plan, header.frames[i], payload, offsets[i], out_np,
                               base_bytes, i, header.version),
        plan.nframes, pool.resolve_threads(threads))


def decode_numpy(blob: bytes | bytearray | memoryview, *,
                 base: torch.Tensor | np.ndarray | None = None,
                 threads: int | None = None, expected_nbytes: int | None = None) -> np.ndarray:
    """Like :func:`decode` but a numpy array; dtypes numpy lacks (bfloat16, float8,
    complex32) raise :class:`CodecError`: use :func:`decode` and convert with torch."""
    header, _ = blobfmt.unpack(blob)
    np_dtype = dtypes.from_name(header.dtype).numpy_dtype
    if np_dtype is None:
        raise CodecError(f"numpy has no {header.dtype} dtype; use decode() to get a tensor")
    t = decode(blob, base=base, threads=threads, expected_nbytes=expected_nbytes)
    return t.view(torch.uint8).numpy().view(np_dtype).reshape(header.shape) if t.ndim else (
        t.reshape(1).view(torch.uint8).numpy().view(np_dtype).reshape(()))


def blob_info(blob: bytes | bytearray | memoryview) -> dict:
    """What a blob holds, read from its header only (no decompression)."""
    header, start = blobfmt.unpack(blob)
    info = dtypes.from_name(header.dtype)
    plan = _plan_from_header(header, info)
    methods = [blobfmt.METHOD_NAMES.get(m, "?") for f in header.frames for m, _ in f.streams]
    return {
        "dtype": header.dtype,
        "shape": header.shape,
        "raw_bytes": plan.nbytes,
        "stored_bytes": len(memoryview(blob).cast("B")),
        "header_bytes": start,
        "frames": len(header.frames),
        "streams_per_frame": header.width,
        "layout": plan.layout.kind,
        "rotation_bits": plan.layout.rotation,
        "delta": header.is_delta,
        "precision_bits": header.precision_bits,
        "precision_factor": (None if header.precision_factor_log2 is None
                             else 2 ** header.precision_factor_log2),
        "precision_factor_rounded": header.factor_rounded,
        "trimmed": header.precision_bits is not None or header.factor_rounded,
        "stream_methods": {name: methods.count(name) for name in sorted(set(methods))},
    }


def verify(blob: bytes | bytearray | memoryview) -> None:
    """Check the header and every frame's stored checksum without decompressing."""
    header, start = blobfmt.unpack(blob)
    _plan_from_header(header, dtypes.from_name(header.dtype))
    view, pos = memoryview(blob).cast("B"), start
    for i, entry in enumerate(header.frames):
        if layout.crc32(view[pos:pos + entry.stored_len]) != entry.stored_crc:
            raise CorruptBlobError(f"codec blob frame {i} is corrupted (stored checksum mismatch)")
        pos += entry.stored_len

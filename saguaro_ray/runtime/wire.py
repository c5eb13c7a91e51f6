"""The control plane's frame codec: authenticated msgpack, never pickle.

A frame is ``HMAC-SHA256(key, stamp ‖ payload) ‖ stamp ‖ payload``; the
payload is msgpack. The :class:`Stamp` — sender id (16 bytes), sequence
number (8), recipient id (a length byte, then up to 255 bytes) — says who sent
the frame, which of its frames it is, and for whom; it sits under the MAC, so
a frame cannot be re-addressed or renumbered without the key. What a receiver
accepts as fresh is :mod:`saguaro_ray.runtime.replay`'s rule; the codec only
carries the stamp. Decoding checks the MAC first
(:func:`hmac.compare_digest`) and only then parses, so an unauthenticated
peer can make us do nothing but hash its bytes. Whatever is wrong with a
frame raises :class:`BadFrame` with a ``reason`` (``"bad mac"``,
``"malformed"``, ``"unknown type"``, ``"bad tensor"``; the replay guard adds
``"replayed"`` and ``"misaddressed"``).

What can cross the wire (anything else is an :class:`EncodeError` at the
sender): ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``,
``list``, ``tuple`` (round-trips as a tuple, so lookup keys stay hashable),
``dict`` (keys of those types, tuples included), CPU or device
``torch.Tensor`` of a whitelisted dtype (decoded on the CPU), and dataclasses
registered with :func:`register` — every worker-protocol message is
registered below. Decoding rebuilds a dataclass through its constructor (so
``SamplingParams`` re-validates) and refuses names that are not registered.

Encoding, in the msgpack tree: a tuple is an array whose first element is the
extension marker ``ExtType(1, b"")``; a dataclass is ``[ExtType(2, name), field,
value, field, value, ...]`` (flat, so a frozen one can be a map key); a tensor is ``[ExtType(3, b""), dtype, shape, raw bytes]``.
User data can never contain an extension object (the encoder rejects it), so
a marker-led array is unambiguous, and an extension anywhere else is
malformed. All tensor handling is :func:`tensor_to_wire` /
:func:`tensor_from_wire`, the one place to swap when tensors move to the
torch.distributed data plane.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import math
import secrets
import struct
from typing import Any, NamedTuple, TypeVar

import msgpack
import torch

from saguaro_ray.algorithms.logprobs import TokenLogprobs
from saguaro_ray.config import ResponseFormat, SamplingParams, Strategy

# the frame errors and their reasons live in saguaro_ray.errors; the codec re-exports them
from saguaro_ray.errors import BAD_MAC, BAD_TENSOR, MALFORMED, MISADDRESSED, REASONS, REPLAYED, UNKNOWN_TYPE, BadFrame, EncodeError  # noqa: F401
from saguaro_ray.workers.messages import BuildItem, KVDelta, LookupResult, NextRound, Outcome, Proposal, SeqStep, Timed, VerifyItem

__all__ = [
    "BadFrame",
    "EncodeError",
    "FrameCodec",
    "MAC_SIZE",
    "Stamp",
    "UNSTAMPED",
    "new_key",
    "pack_payload",
    "register",
    "registered_types",
    "tensor_from_wire",
    "tensor_to_wire",
    "unpack_payload",
]

MAC_SIZE = 32  # bytes of HMAC-SHA256
MIN_KEY_BYTES = 16
MAX_TENSOR_DIMS = 16


def new_key() -> bytes:
    """A fresh 32-byte HMAC key (one per engine, handed to workers through Ray)."""
    return secrets.token_bytes(32)


# ---------------------------------------------------------------- registry

_EXT_TUPLE = 1
_EXT_DATACLASS = 2
_EXT_TENSOR = 3
_TUPLE_MARK = msgpack.ExtType(_EXT_TUPLE, b"")
_TENSOR_MARK = msgpack.ExtType(_EXT_TENSOR, b"")

_BY_NAME: dict[str, type] = {}
_BY_WIRE_NAME: dict[bytes, tuple[type, str, frozenset[str]]] = {}  # the marker's bytes → (class, name, fields)
_BY_TYPE: dict[type, tuple[msgpack.ExtType, tuple[str, ...], frozenset[str]]] = {}

C = TypeVar("C", bound=type)


def register(cls: C, name: str | None = None) -> C:
    """Allow dataclass ``cls`` on the wire under ``name`` (default: its class name).

    Only the constructor's fields travel; decoding calls ``cls(**fields)``.
    Usable as a decorator. Registering a different class under a taken name
    is an error; registering the same class again is a no-op.
    """
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise TypeError(f"only dataclasses can be registered for the wire, got {cls!r}")
    name = cls.__name__ if name is None else name
    if not isinstance(name, str) or not name:
        raise ValueError(f"wire name must be a non-empty string, got {name!r}")
    existing = _BY_NAME.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"wire name {name!r} is already registered for {existing.__module__}.{existing.__qualname__}")
    if cls in _BY_TYPE and existing is None:
        raise ValueError(f"{cls.__qualname__} is already registered under another wire name")
    fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    _BY_NAME[name] = cls
    _BY_TYPE[cls] = (msgpack.ExtType(_EXT_DATACLASS, name.encode("utf-8")), fields, frozenset(fields))
    _BY_WIRE_NAME[name.encode("utf-8")] = (cls, name, frozenset(fields))
    return cls


def registered_types() -> dict[str, type]:
    """Wire name → class, for every registered dataclass."""
    return dict(_BY_NAME)


for _cls in (SamplingParams, Strategy, ResponseFormat, SeqStep, Proposal, VerifyItem, BuildItem, KVDelta, LookupResult, NextRound, Outcome, TokenLogprobs, Timed):
    register(_cls)


# ---------------------------------------------------------------- tensors

# the tensor dtypes that may travel (in frames, or over the data plane), by wire name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


def tensor_to_wire(t: torch.Tensor) -> tuple:
    """``(marker, dtype name, shape, raw bytes)``; device tensors are copied to the CPU."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise EncodeError(f"tensor dtype {t.dtype} cannot be sent; allowed: {', '.join(DTYPES)}")
    if t.layout != torch.strided:
        raise EncodeError(f"only dense (strided) tensors can be sent, got layout {t.layout}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return (_TENSOR_MARK, name, tuple(int(d) for d in t.shape), data)


def tensor_from_wire(dtype_name: Any, shape: Any, data: Any) -> torch.Tensor:
    """Rebuild a CPU tensor, checking dtype, shape and that the byte count matches."""
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise BadFrame(BAD_TENSOR, f"dtype {dtype_name!r} is not allowed")
    if type(shape) is list:  # a plain array, as the decoder hands it over
        shape = tuple(shape)
    if type(shape) is not tuple or len(shape) > MAX_TENSOR_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise BadFrame(BAD_TENSOR, f"invalid shape {shape!r}")
    if type(data) is not bytes:
        raise BadFrame(BAD_TENSOR, "tensor data is not bytes")
    numel = math.prod(shape)
    if numel * _ITEMSIZE[dtype_name] != len(data):
        raise BadFrame(BAD_TENSOR, f"{len(data)} bytes do not hold a {dtype_name} tensor of shape {list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ---------------------------------------------------------------- payloads

_SCALARS = (type(None), bool, int, float, str, bytes)
# exact types that need no conversion either way (checked inline: the common
# case — token lists, scalar fields — then costs no function call)
_PLAIN = frozenset(_SCALARS)


def _to_wire(obj: Any) -> Any:
    t = type(obj)
    if t in _PLAIN:
        return obj
    if t is list:
        return [x if type(x) in _PLAIN else _to_wire(x) for x in obj]
    if t is tuple or t is torch.Size:
        return (_TUPLE_MARK, *(x if type(x) in _PLAIN else _to_wire(x) for x in obj))
    if t is dict:
        try:
            return {_to_wire(k): (v if type(v) in _PLAIN else _to_wire(v)) for k, v in obj.items()}
        except TypeError as e:  # a key that encodes to something unhashable (a list, a dataclass)
            if isinstance(e, EncodeError):
                raise
            raise EncodeError(f"dict key cannot be sent: {e}") from None
    entry = _BY_TYPE.get(t)
    if entry is not None:
        mark, fields, _ = entry
        out = [mark]
        for f in fields:
            v = getattr(obj, f)
            out.append(f)
            out.append(v if type(v) in _PLAIN else _to_wire(v))
        return tuple(out)
    if isinstance(obj, torch.Tensor):
        return tensor_to_wire(obj)
    if t is bytearray or t is memoryview:
        return bytes(obj)
    if isinstance(obj, enum.Enum):  # a str-valued enum (a proposal's source) travels as its value
        return _to_wire(obj.value)
    if dataclasses.is_dataclass(obj):
        raise EncodeError(f"dataclass {t.__module__}.{t.__qualname__} is not registered for the wire; call saguaro_ray.runtime.wire.register({t.__qualname__})")
    raise EncodeError(f"objects of type {t.__module__}.{t.__qualname__} cannot be sent over the control plane")


# Decoding runs inside msgpack: the unpacker calls these hooks bottom-up on
# every array and map it builds, so children arrive already converted and no
# Python walk over the tree is needed.
_EXT = msgpack.ExtType


def _array_hook(x: tuple) -> Any:
    if x and type(x[0]) is _EXT:
        return _from_marked(x)
    if _EXT in set(map(type, x)):
        raise BadFrame(MALFORMED, "stray extension object in an array")
    return list(x)


def _map_hook(d: dict) -> dict:
    if _EXT in set(map(type, d)) or _EXT in set(map(type, d.values())):
        raise BadFrame(MALFORMED, "stray extension object in a map")
    return d


def _from_marked(x: tuple) -> Any:
    mark = x[0]
    if mark.code == _EXT_TUPLE and mark.data == b"":
        return x[1:]
    if mark.code == _EXT_TENSOR and mark.data == b"":
        if len(x) != 4:
            raise BadFrame(BAD_TENSOR, f"tensor record has {len(x) - 1} fields, expected 3")
        return tensor_from_wire(x[1], x[2], x[3])
    if mark.code == _EXT_DATACLASS:
        entry = _BY_WIRE_NAME.get(mark.data)
        if entry is None:
            try:
                name = mark.data.decode("utf-8")
            except UnicodeDecodeError:
                raise BadFrame(MALFORMED, "type name is not UTF-8") from None
            raise BadFrame(UNKNOWN_TYPE, f"type {name!r} is not registered")
        cls, name, allowed = entry
        if len(x) % 2 != 1:
            raise BadFrame(MALFORMED, f"{name} record is not [marker, field, value, ...]")
        names = x[1::2]
        try:
            known = allowed.issuperset(names)  # allowed holds only str, so this also checks the types
        except TypeError:  # an unhashable field name
            known = False
        if not known:
            extra = [k for k in names if type(k) is not str or k not in allowed]
            raise BadFrame(MALFORMED, f"{name} has no field(s) {extra!r}")
        if len(set(names)) != len(names):
            raise BadFrame(MALFORMED, f"{name} record repeats a field")
        kwargs = dict(zip(names, x[2::2]))
        try:
            return cls(**kwargs)
        except Exception as e:  # missing fields, constructor validation
            raise BadFrame(MALFORMED, f"cannot build {name}: {type(e).__name__}: {e}") from None
    raise BadFrame(MALFORMED, f"unknown extension code {mark.code}")


def pack_payload(obj: Any) -> bytes:
    """msgpack bytes for ``obj`` (no MAC); :class:`EncodeError` if not wire-safe."""
    tree = _to_wire(obj)
    try:
        return msgpack.packb(tree, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as e:  # e.g. an int beyond 64 bits
        raise EncodeError(f"cannot encode: {e}") from None


def unpack_payload(payload: bytes | memoryview) -> Any:
    """Inverse of :func:`pack_payload`; :class:`BadFrame` on anything wrong."""
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=False, list_hook=_array_hook, object_hook=_map_hook)
    except BadFrame:
        raise
    except RecursionError:
        raise BadFrame(MALFORMED, "nested too deeply") from None
    except Exception as e:  # ExtraData, FormatError, StackError, ValueError, TypeError (unhashable key), ...
        raise BadFrame(MALFORMED, f"not msgpack: {type(e).__name__}: {e}") from None
    if type(obj) is _EXT:
        raise BadFrame(MALFORMED, f"stray extension object (code {obj.code})")
    return obj


# ---------------------------------------------------------------- frames

SENDER_ID_BYTES = 16
_STAMP = struct.Struct(">16sQB")  # sender id, sequence number, recipient length
MAX_RECIPIENT_BYTES = 255


class Stamp(NamedTuple):
    """Who sent a frame (a random id per sending endpoint), its sequence
    number there (1, 2, ...), and its recipient (``b""``: anyone)."""

    sender: bytes
    seq: int
    to: bytes


UNSTAMPED = Stamp(bytes(SENDER_ID_BYTES), 0, b"")  # for frames no receiver checks for freshness


def _pack_stamp(stamp: Stamp) -> bytes:
    sender, seq, to = stamp
    if type(sender) is not bytes or len(sender) != SENDER_ID_BYTES:
        raise ValueError(f"a stamp's sender id must be {SENDER_ID_BYTES} bytes")
    if type(to) is not bytes or len(to) > MAX_RECIPIENT_BYTES:
        raise ValueError(f"a stamp's recipient must be at most {MAX_RECIPIENT_BYTES} bytes")
    if type(seq) is not int or not 0 <= seq < 1 << 64:
        raise ValueError(f"a stamp's sequence number must fit 64 unsigned bits, got {seq!r}")
    return _STAMP.pack(sender, seq, len(to)) + to


class FrameCodec:
    """Encode / decode authenticated, stamped frames with one shared key.

    Stateless after construction and safe to share between threads. HMAC
    gives integrity and authenticity, not secrecy; freshness (no replays) is
    the receiver's check of the :class:`Stamp` (see
    :class:`saguaro_ray.runtime.replay.ReplayGuard`): :meth:`decode` ignores
    it, :meth:`unseal` hands it over.
    """

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"the frame key must be bytes, got {type(key).__name__}")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the frame key must be at least {MIN_KEY_BYTES} bytes (use saguaro_ray.runtime.wire.new_key()), got {len(key)}")
        self._key = bytes(key)

    def seal(self, payload: bytes, stamp: Stamp = UNSTAMPED) -> bytes:
        """``MAC ‖ stamp ‖ payload``."""
        head = _pack_stamp(stamp)
        mac = hmac.new(self._key, head, hashlib.sha256)
        mac.update(payload)
        return mac.digest() + head + payload

    def unseal(self, frame: bytes | bytearray | memoryview) -> tuple[Stamp, memoryview]:
        """The stamp and payload (a view into ``frame``, no copy) of an
        authentic frame; :class:`BadFrame` ("bad mac") otherwise."""
        view = memoryview(frame).cast("B")
        if len(view) < MAC_SIZE + _STAMP.size:
            raise BadFrame(BAD_MAC, f"frame of {len(view)} bytes is shorter than its MAC and stamp")
        body = view[MAC_SIZE:]
        if not hmac.compare_digest(view[:MAC_SIZE], hmac.new(self._key, body, hashlib.sha256).digest()):
            raise BadFrame(BAD_MAC, "authentication failed (wrong key or altered frame)")
        sender, seq, n = _STAMP.unpack_from(body)
        end = _STAMP.size + n
        if len(body) < end:  # authentic, so only a buggy sender gets here
            raise BadFrame(MALFORMED, "the stamp's recipient runs past the frame")
        return Stamp(sender, seq, bytes(body[_STAMP.size : end])), body[end:]

    def encode(self, obj: Any, stamp: Stamp = UNSTAMPED) -> bytes:
        return self.seal(pack_payload(obj), stamp)

    def decode(self, frame: bytes | bytearray | memoryview) -> Any:
        """The content of an authentic frame (its stamp unchecked)."""
        return unpack_payload(self.unseal(frame)[1])


"""The control-plane frame codec: round trips, and every way a frame can be bad;
the stamp every frame carries, and the replay guard's rule for which are fresh."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest
import torch

from saguaro_ray.config import SamplingParams
from saguaro_ray.runtime.wire import (
    MAC_SIZE,
    BadFrame,
    EncodeError,
    FrameCodec,
    Stamp,
    new_key,
    pack_payload,
    register,
    registered_types,
    unpack_payload,
)
from saguaro_ray.runtime import replay
from saguaro_ray.runtime.replay import ReplayGuard, Sender
from saguaro_ray.workers.messages import BuildItem, NextRound, Outcome, Proposal, ProposalSource, SeqStep, Timed, VerifyItem

KEY = b"k" * 32
codec = FrameCodec(KEY)


def roundtrip(obj):
    return codec.decode(codec.encode(obj))


def same(a, b) -> bool:
    """Deep equality that compares tensors exactly (dtype, shape, values) and container types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def step(seq_id: int = 3, greedy: bool = False) -> SeqStep:
    params = SamplingParams(temperature=0.0 if greedy else 0.7, top_k=5, top_p=0.9, max_tokens=12, seed=11)
    return SeqStep(seq_id, 17, [4, 5, 6], params, seed=99, output_pos=2, recent=[1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8, torch.bool])
def test_tensor_dtypes_roundtrip(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 7, generator=g) * 50).to(dtype)
    out = roundtrip(t)
    assert same(out, t)
    assert out.device.type == "cpu"


def test_tensor_shapes_roundtrip():
    for t in [torch.tensor(2.5), torch.zeros(0, 5), torch.arange(24).reshape(2, 3, 4), torch.arange(12.0).reshape(3, 4).t()]:
        assert same(roundtrip(t), t.contiguous())
    out = roundtrip(torch.ones(2, requires_grad=True))
    assert not out.requires_grad


@pytest.mark.parametrize("q", [None, torch.rand(3, 16), torch.rand(3, 16).to(torch.bfloat16)])
def test_every_message_roundtrips(q):
    prop = Proposal([7, 8, 9], q, "cache")
    messages = [
        SamplingParams(),
        step(),
        step(greedy=True),
        prop,
        VerifyItem(step(), prop, rule="fuzzy", tau=0.25, div="tv"),
        VerifyItem(step(), prop, rule="assisted"),
        NextRound([3, 2], "fast", [[2, 1, 1, 0], [1, 1, 1]], [[4, 0, 0, 0], [3, 0, 0]], [5, 6, 7]),
        BuildItem(step(), prop, fanout=[2, 1, 1, 0], k_next=4, shard=1, num_shards=2),
        Outcome(3, 2, 41, 3),
        Timed([Outcome(1, 0, 5), Outcome(2, 3, 6, 3)], 1.25, 2.5),
    ]
    for m in messages:
        out = roundtrip(m)
        assert type(out) is type(m) and same(out, m), m
    batch = roundtrip([VerifyItem(step(i), prop) for i in range(4)])
    assert [v.step.seq_id for v in batch] == [0, 1, 2, 3]


def test_a_proposals_source_travels_as_its_value_and_comes_back_an_enum():
    """``ProposalSource`` is a str-valued enum: on the wire it is the plain string."""
    out = roundtrip(Proposal([1], None, ProposalSource.NEURAL))
    assert out.source is ProposalSource.NEURAL and out.source == "neural"
    assert roundtrip(ProposalSource.FAST) == "fast"


def test_tuples_and_containers_preserved():
    keys = [(1, 0, 42), (1, 2, 7)]
    results = [(Proposal([1, 2], torch.rand(2, 4)), 3), (None, None)]
    obj = {
        "keys": keys,
        "results": results,
        (1, 2): "tuple key",
        5: [True, 1, 1.5, None, b"\x00\xff", "s"],
        "nested": ((1, (2, 3)), [(4,)]),
        "empty": ((), [], {}),
    }
    out = roundtrip(obj)
    assert same(out, obj)
    assert type(out["keys"][0]) is tuple and type(out[5][0]) is bool and type(out[5][1]) is int
    assert out[(1, 2)] == "tuple key"
    assert roundtrip(torch.Size([2, 3])) == (2, 3)


def test_encode_rejects_what_cannot_be_sent():
    @dataclasses.dataclass
    class NotRegistered:
        x: int = 1

    for bad in [object(), {1, 2}, NotRegistered(), torch.zeros(2, dtype=torch.complex64), 1 << 70, msgpack.ExtType(1, b"")]:
        with pytest.raises(EncodeError):
            codec.encode({"x": [bad]})


def test_register():
    @dataclasses.dataclass(frozen=True)
    class WireTestPoint:
        x: int
        y: tuple = (0, 0)

    register(WireTestPoint)
    register(WireTestPoint)  # idempotent
    assert registered_types()["WireTestPoint"] is WireTestPoint
    assert same(roundtrip({WireTestPoint(1, (2, 3)): 1}), {WireTestPoint(1, (2, 3)): 1})

    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(ValueError):
        register(Other, "WireTestPoint")
    with pytest.raises(TypeError):
        register(dict)
    assert {"SeqStep", "Proposal", "VerifyItem", "BuildItem", "Outcome", "Timed", "SamplingParams"} <= set(registered_types())


def reason(frame: bytes, c: FrameCodec = codec) -> str:
    with pytest.raises(BadFrame) as info:
        c.decode(frame)
    return info.value.reason


def test_authentication_failures():
    frame = codec.encode([step(), Proposal([1], torch.rand(1, 8))])
    assert reason(frame, FrameCodec(b"x" * 32)) == "bad mac"  # wrong key
    for i in (0, MAC_SIZE - 1, MAC_SIZE, len(frame) // 2, len(frame) - 1):
        tampered = bytearray(frame)
        tampered[i] ^= 0x01
        assert reason(bytes(tampered)) == "bad mac"
    assert reason(frame[:-1]) == "bad mac"  # truncated
    assert reason(frame[:10]) == "bad mac"  # shorter than the MAC
    assert reason(b"") == "bad mac"
    assert reason(b"\x00" * 200) == "bad mac"


def test_authenticated_but_bad_payloads():
    payload = pack_payload([step(), Outcome(1, 2, 3)])
    assert reason(codec.seal(payload[:-3])) == "malformed"  # truncated payload, valid MAC
    assert reason(codec.seal(payload + b"\x01")) == "malformed"  # trailing bytes
    assert reason(codec.seal(pickle.dumps({"a": 1}))) == "malformed"  # never unpickled
    assert reason(codec.seal(b"\xc1")) == "malformed"  # reserved msgpack byte

    def sealed(tree) -> bytes:
        return codec.seal(msgpack.packb(tree, use_bin_type=True))

    dc = lambda name: msgpack.ExtType(2, name.encode())  # noqa: E731
    assert reason(sealed([dc("os.system")])) == "unknown type"
    good = [dc("Outcome"), "seq_id", 1, "accepted", 0, "next_token", 2]
    assert same(unpack_payload(msgpack.packb(good)), Outcome(1, 0, 2))
    assert reason(sealed(good + ["evil", 1])) == "malformed"  # unknown field
    assert reason(sealed(good + ["seq_id", 1])) == "malformed"  # repeated field
    assert reason(sealed(good + ["proposed"])) == "malformed"  # odd record
    assert reason(sealed(good[:3])) == "malformed"  # missing fields
    assert reason(sealed([dc("SamplingParams"), "temperature", -1.0])) == "malformed"  # constructor validation
    assert reason(sealed([dc("Outcome"), [1, 2, 3]])) == "malformed"
    assert reason(sealed({"x": msgpack.ExtType(1, b"")})) == "malformed"  # stray marker
    assert reason(sealed([msgpack.ExtType(9, b"")])) == "malformed"  # unknown extension
    assert reason(sealed({(1, 2): 0})) == "malformed"  # a plain array (a list) as a map key

    tmark = msgpack.ExtType(3, b"")
    assert reason(sealed([tmark, "float32", [2, 2], b"\x00" * 15])) == "bad tensor"  # bytes ≠ shape × itemsize
    assert reason(sealed([tmark, "float32", [2, 2], b"\x00" * 17])) == "bad tensor"
    assert reason(sealed([tmark, "object", [1], b"\x00"])) == "bad tensor"  # dtype not whitelisted
    assert reason(sealed([tmark, "float32", [-1], b""])) == "bad tensor"
    assert reason(sealed([tmark, "float32", [True], b"\x00" * 4])) == "bad tensor"
    assert reason(sealed([tmark, "float32", [1], "abcd"])) == "bad tensor"
    assert reason(sealed([tmark, "float32", [1]])) == "bad tensor"
    ok = unpack_payload(msgpack.packb([tmark, "float32", [2], b"\x00" * 8], use_bin_type=True))
    assert same(ok, torch.zeros(2))


def test_keys():
    k = new_key()
    assert isinstance(k, bytes) and len(k) == 32 and k != new_key()
    with pytest.raises(ValueError):
        FrameCodec(b"short")
    with pytest.raises(TypeError):
        FrameCodec("a string key of enough length")  # type: ignore[arg-type]
    a, b = FrameCodec(k), FrameCodec(bytes(k))
    assert b.decode(a.encode({"x": 1})) == {"x": 1}
    err = BadFrame("bad mac", "detail")
    again = pickle.loads(pickle.dumps(err))
    assert again.reason == "bad mac" and str(again) == str(err)


# ---------------------------------------------------------------- stamps and replays


def test_the_stamp_travels_under_the_mac():
    sender = Sender()
    stamp = sender.stamp(b"server-id")
    assert stamp == Stamp(sender.id, 1, b"server-id") and sender.last == 1
    frame = codec.encode({"x": 1}, stamp)
    got, payload = codec.unseal(frame)
    assert got == stamp and unpack_payload(payload) == {"x": 1}
    head = MAC_SIZE + 16 + 8  # the sequence number's last byte
    renumbered = bytearray(frame)
    renumbered[head - 1] ^= 0x01
    assert reason(bytes(renumbered)) == "bad mac"
    with pytest.raises(ValueError):
        codec.encode({}, Stamp(b"short", 1, b""))
    with pytest.raises(ValueError):
        codec.encode({}, Stamp(sender.id, 1, b"x" * 256))


def _reason(guard: ReplayGuard, stamp: Stamp) -> str | None:
    try:
        guard.admit(stamp)
    except BadFrame as e:
        return e.reason
    return None


def test_the_window_accepts_each_number_once_in_any_order_within_it():
    guard = ReplayGuard(b"me", open_door=True)
    a = Sender()
    s = [a.stamp(b"me") for _ in range(6)]
    assert [_reason(guard, s[i]) for i in (0, 2, 1, 5, 3)] == [None] * 5  # reordered: fine
    assert [_reason(guard, s[i]) for i in (0, 2, 5)] == ["replayed"] * 3
    assert _reason(guard, s[4]) is None
    assert _reason(guard, Sender().stamp(b"me")) is None  # a new sender (epoch) starts fresh
    assert _reason(guard, a.stamp(b"someone else")) == "misaddressed"
    late = a.stamp(b"me")
    for _ in range(replay.WINDOW):
        assert _reason(guard, a.stamp(b"me")) is None
    assert _reason(guard, late) == "replayed"  # older than the window


def test_a_closed_door_accepts_only_introduced_senders_above_their_floor():
    guard = ReplayGuard(b"", open_door=False)
    pub = Sender()
    old = [pub.stamp() for _ in range(3)]
    assert _reason(guard, old[0]) == "misaddressed"  # not introduced yet
    guard.introduce(pub.id, pub.last)
    assert [_reason(guard, st) for st in old] == ["replayed"] * 3  # from before the introduction
    assert _reason(guard, pub.stamp()) is None
    assert _reason(guard, Sender().stamp()) == "misaddressed"


def test_senders_are_bounded(monkeypatch):
    monkeypatch.setattr(replay, "MAX_SENDERS", 3)
    guard = ReplayGuard(b"me", open_door=True)
    senders = [Sender() for _ in range(4)]
    firsts = [s.stamp(b"me") for s in senders]
    for st in firsts:
        guard.admit(st)
    assert list(guard._windows) == [s.id for s in senders[1:]]  # the least recently heard-from left

"""The torch.distributed data plane, on real gloo groups in real processes.

A few long-lived "agent" processes (spawned once for the module: importing
torch costs seconds on these machines) each run jobs the test sends them —
join a generation, send, resolve, close — and keep their planes between
jobs, the way a worker actor keeps its plane between calls. Jobs that must
run together (joining; a send and its receive) are sent to every agent
before any answer is awaited. Nothing is mocked: every byte crosses gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from saguaro_ray.config import SamplingParams
from saguaro_ray.runtime.data_plane import (
    DataPlane,
    DataPlaneError,
    DataPlaneStore,
    JoinTimeout,
    KVDeltaRef,
    StoreClient,
    TensorRef,
    TransferLost,
    discard_refs,
    offload_kv,
    offload_q,
    recv_kv,
    resolve,
    send_kv,
)
from saguaro_ray.runtime.data_plane.devices import DeviceIdentity, choose_backend, indexed_device
from saguaro_ray.runtime.data_plane.status import PlaneStatus, fallback_cause
from saguaro_ray.runtime.wire import FrameCodec, new_key
from saguaro_ray.workers.messages import BuildItem, KVDelta, LookupResult, Proposal, SeqStep, Timed, VerifyItem

KEY = b"k" * 32  # a fixed frame key, shared with the agents
V = 24  # vocabulary width of the q rows
JOB_TIMEOUT_S = 30.0

# ---------------------------------------------------------------- agent side

_PLANES: dict[int, DataPlane] = {}  # generation → this agent's plane


def _agent_main(conn: Any) -> None:
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as e:  # noqa: BLE001 — reported to the test
            try:
                conn.send(("err", e, traceback.format_exc()))
            except Exception:  # noqa: BLE001 — unpicklable: send its text
                conn.send(("err", RuntimeError(repr(e)), traceback.format_exc()))


def payload(seed: int, rows: int, width: int = V, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic tensor both the agents and the test can rebuild."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand((rows, width), generator=g).to(dtype)


def job_join(address: str, rank: int, world: int, gen: int, timeout_s: float = 20.0, identity: DeviceIdentity | None = None) -> float:
    t0 = time.monotonic()
    _PLANES[gen] = DataPlane.join(address, KEY, rank, world, gen, timeout_s=timeout_s, identity=identity)
    return time.monotonic() - t0


def job_formed(gen: int) -> tuple[str, str | None, tuple[int, ...], dict[str, int]]:
    """What the formation settled: backend, its note, the peers warmed up, the stats."""
    plane = _PLANES[gen]
    return plane.backend, plane.backend_note, plane.warmed, plane.stats()


def job_close(gen: int, flush_s: float = 5.0) -> bool:
    plane = _PLANES.pop(gen)
    flushed = plane.flush(flush_s)
    plane.close()
    return flushed


def job_abandon(gen: int) -> None:
    _PLANES.pop(gen).close()


def job_send(gen: int, sends: list[tuple[int, int, int]]) -> list[int]:
    """Send ``payload(seed, rows)`` to each ``(dst, seed, rows)``; the tags used."""
    plane = _PLANES[gen]
    return [plane.send(payload(seed, rows), dst) for dst, seed, rows in sends]


def job_recv(gen: int, recvs: list[tuple[int, int, int]], timeout_s: float = 10.0) -> list[Any]:
    """Receive each ``(src, tag, rows)`` in the order given; a TransferLost is returned, not raised."""
    plane = _PLANES[gen]
    out: list[Any] = []
    for src, tag, rows in recvs:
        t0 = time.monotonic()
        try:
            out.append(plane.recv(src, tag, (rows, V), torch.float32, timeout_s))
        except TransferLost as e:
            out.append((e, time.monotonic() - t0))
    return out


def job_send_to_dead(gen: int, dst: int) -> Any:
    """A send to a member known to be gone raises TransferLost at once."""
    try:
        _PLANES[gen].send(payload(0, 1), dst)
    except TransferLost as e:
        return e
    return None


def job_memo_identity(gen: int, src: int, tag: int, rows: int) -> tuple[bool, dict[str, int]]:
    """Ask for a transfer twice: the second is the memoised tensor, no receive posted."""
    plane = _PLANES[gen]
    a = plane.recv(src, tag, (rows, V), torch.float32, 5.0)
    b = plane.recv(src, tag, (rows, V), "float32", 0.01)
    return a is b, plane.stats()


def _reply(seeds: list[int]) -> Any:
    """A draft-shaped reply: proposals nested in tuples, a LookupResult, a Timed."""
    props = [Proposal(tokens=list(range(s % 3 + 2)), q=payload(s, s % 3 + 2), source="draft") for s in seeds]
    pairs: list[tuple[Proposal | None, int | None]] = [(props[0], 3), (None, None), (props[1], 1)]
    lookups = [LookupResult(proposal=props[2], rank=0), LookupResult(proposal=None, rank=None)]
    return Timed(value={"pairs": pairs, "lookups": lookups, "point": Proposal(tokens=[5], q=None)}, start=1.0, end=2.0)


def job_offload(gen: int, seeds: list[int], dst: int) -> tuple[bytes, bool]:
    """Offload a reply's q rows to ``dst``; returns the frame and whether the original was left intact."""
    reply = _reply(seeds)
    out = offload_q(reply, _PLANES[gen], dst)
    originals = [p for p, _ in reply.value["pairs"] if p is not None] + [reply.value["lookups"][0].proposal]
    intact = all(isinstance(p.q, torch.Tensor) for p in originals)
    return FrameCodec(KEY).encode(out), intact


def job_resolve(gen: int, frame: bytes, timeout_s: float = 10.0) -> tuple[Any, Any, dict[str, int]]:
    """Resolve a call's arguments twice (the second time as a retry would)."""
    plane = _PLANES[gen]
    args = FrameCodec(KEY).decode(frame)
    first = resolve(args, plane, timeout_s)
    again = resolve(args, plane, 0.2)  # the senders sent once: only the memo can answer
    still_refs = all(isinstance(i.proposal.q, TensorRef) for i in args if i.proposal.q is not None)
    return (first, still_refs), again, plane.stats()


def job_send_kv(gen: int, seed: int, layers: int, n: int, dsts: list[int], dtype: torch.dtype) -> bytes:
    plane = _PLANES[gen]
    ref = send_kv(plane, make_kv(seed, layers, n, dtype), dsts)
    ext = offload_kv(KVDelta(seq_id=7, start=3, tokens=[1, 2], rankings=[[1, 2], [2, 1]], kv=make_kv(seed + 1, layers, n, dtype)), plane, dsts)
    return FrameCodec(KEY).encode((ref, ext))


def job_kv_edges(gen: int) -> tuple[Any, Any, Any]:
    """No receivers: the delta stays inline. Zero rows: nothing is sent, an empty delta resolves."""
    plane = _PLANES[gen]
    ext = KVDelta(seq_id=1, start=0, tokens=[1], rankings=[[1]], kv=make_kv(1, 2, 1, torch.float32))
    kept = offload_kv([ext], plane, [plane.rank])[0]
    empty = send_kv(plane, make_kv(2, 2, 0, torch.float32), [1])
    return kept is ext, empty, recv_kv(plane, empty, 0.1)


def job_recv_kv(gen: int, frame: bytes) -> tuple[Any, Any]:
    plane = _PLANES[gen]
    ref, ext = FrameCodec(KEY).decode(frame)
    kv = recv_kv(plane, ref, 10.0)
    built = resolve([BuildItem(step=_step(), proposal=Proposal(tokens=[1]), fanout=[1, 1], k_next=2, kv_delta=ext)], plane, 10.0)
    return kv, built[0].kv_delta.kv


def _settle(plane: DataPlane, key: str) -> dict[str, int]:
    """The plane's stats once ``key`` is 0 (waiter threads finish on their own), or after 10 s."""
    deadline = time.monotonic() + 10.0
    while plane.stats()[key] and time.monotonic() < deadline:
        time.sleep(0.05)
    return plane.stats()


def job_pending_sends(gen: int, settle: bool = True) -> tuple[dict[str, int], int]:
    import threading

    plane = _PLANES[gen]
    return _settle(plane, "pending_sends") if settle else plane.stats(), threading.active_count()


def job_discard(gen: int, frame: bytes) -> tuple[int, dict[str, int], Any]:
    """Discard every reference in a reply, then resolve them anyway: the memo holds what was taken."""
    plane = _PLANES[gen]
    reply = FrameCodec(KEY).decode(frame)
    refs = [p.q for p, _ in reply.value["pairs"] if p is not None] + [reply.value["lookups"][0].proposal.q]
    taken = discard_refs(refs + refs, plane)  # twice: taking a transfer again is a no-op
    stats = _settle(plane, "pending_recvs")
    again = resolve([VerifyItem(step=_step(), proposal=Proposal(tokens=[1, 2], q=refs[0]))], plane, 0.5)
    return taken, stats, again[0].proposal.q


def make_kv(seed: int, layers: int, n: int, dtype: torch.dtype, hkv: int = 2, d: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, hkv, d), generator=g).to(dtype), torch.randn((n, hkv, d), generator=g).to(dtype)) for _ in range(layers)]


def _step() -> SeqStep:
    return SeqStep(seq_id=1, start=0, new_tokens=[1], params=SamplingParams(), seed=0, output_pos=0)


# ---------------------------------------------------------------- test side


class Agents:
    """The agent processes, indexed by slot (= rank in every generation)."""

    def __init__(self, n: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        for i in range(n):
            self.start(i)

    def start(self, i: int) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_agent_main, args=(child,), daemon=True, name=f"data-plane-agent-{i}")
        p.start()
        child.close()
        self.procs[i], self.conns[i] = p, parent

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].join(5)
        self.conns[i].close()

    def submit(self, i: int, fn: Callable[..., Any], *args: Any) -> None:
        self.conns[i].send((fn, args))

    def result(self, i: int, timeout_s: float = JOB_TIMEOUT_S) -> Any:
        if not self.conns[i].poll(timeout_s):
            raise AssertionError(f"agent {i} did not answer within {timeout_s}s")
        msg = self.conns[i].recv()
        if msg[0] == "err":
            raise AssertionError(f"agent {i} raised {msg[1]!r}\n{msg[2]}")
        return msg[1]

    def call(self, i: int, fn: Callable[..., Any], *args: Any) -> Any:
        self.submit(i, fn, *args)
        return self.result(i)

    def all(self, jobs: dict[int, tuple]) -> dict[int, Any]:
        """Run ``{slot: (fn, *args)}`` concurrently; their results."""
        for i, (fn, *args) in jobs.items():
            self.submit(i, fn, *args)
        return {i: self.result(i) for i in jobs}

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
            p.join(5)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def agents() -> Any:
    a = Agents(3)
    yield a
    a.close()


@pytest.fixture(scope="module")
def store() -> Any:
    s = DataPlaneStore(KEY, "127.0.0.1")
    yield s
    s.close()


_GEN = iter(range(1, 1000))


@pytest.fixture()
def gen(agents: Agents, store: DataPlaneStore) -> Any:
    """A fresh generation joined by all three agents; closed afterwards."""
    g = next(_GEN)
    took = agents.all({r: (job_join, store.address, r, 3, g) for r in range(3)})
    assert all(t < 15 for t in took.values())
    yield g
    agents.all({r: (job_abandon, g) for r in range(3)})


def _addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback."""
    import json
    import subprocess

    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=False).stdout or "[]"
    return [a["local"] for link in json.loads(out) for a in link.get("addr_info", []) if not a["local"].startswith("127.")]


def test_the_store_listens_only_where_it_was_bound(store: DataPlaneStore) -> None:
    """torch's TCPStore listened on every interface whatever host it got; the
    store answers only on the address it was bound to."""
    import socket

    assert store.address.startswith("tcp://127.0.0.1:")
    port = int(store.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    others = _addresses()
    if not others:
        pytest.skip("no non-loopback interface on this machine")
    for addr in others:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((addr, port), timeout=2).close()


def test_the_store_refuses_a_client_without_the_key(store: DataPlaneStore) -> None:
    """A peer that reaches the store but lacks the engine's key can neither
    join nor read a generation's keys: its calls are dropped unanswered."""
    before = store.drop_reasons.get("bad mac", 0)
    with pytest.raises(JoinTimeout, match="cannot reach the rendezvous store"):
        DataPlane.join(store.address, b"w" * 32, 0, 2, 950, timeout_s=0.5)
    assert store.drop_reasons.get("bad mac", 0) > before
    thief = StoreClient(store.address, b"w" * 32, timeout_s=0.5)
    try:
        with pytest.raises(JoinTimeout):
            thief.get("gen1/rank0")
    finally:
        thief.close()
    honest = StoreClient(store.address, KEY, timeout_s=5.0)
    try:
        assert honest.check(["gen950/rank0"]) is False  # the refused join wrote nothing
    finally:
        honest.close()


def test_rows_across_three_ranks_out_of_order(agents: Agents, gen: int) -> None:
    # rank 0 → 1 (seeds 1, 2), 0 → 2 (seed 3); rank 2 → 1 (seed 4)
    agents.submit(0, job_send, gen, [(1, 1, 3), (1, 2, 5), (2, 3, 2)])
    agents.submit(2, job_send, gen, [(1, 4, 4)])
    tags0, tags2 = agents.result(0), agents.result(2)
    assert len(set(tags0)) == 3 and len(tags2) == 1
    got = agents.all({
        1: (job_recv, gen, [(0, tags0[1], 5), (2, tags2[0], 4), (0, tags0[0], 3)]),  # the later tag first
        2: (job_recv, gen, [(0, tags0[2], 2)]),
    })
    assert torch.equal(got[1][0], payload(2, 5))
    assert torch.equal(got[1][1], payload(4, 4))
    assert torch.equal(got[1][2], payload(1, 3))
    assert torch.equal(got[2][0], payload(3, 2))
    same, stats = agents.call(1, job_memo_identity, gen, 0, tags0[1], 5)
    assert same and stats["pending_recvs"] == 0


def test_recv_timeout_is_quick_and_leaves_the_group_usable(agents: Agents, gen: int) -> None:
    # rank 1 asks for rank 0's second transfer before it exists
    [(lost, took)] = agents.call(1, job_recv, gen, [(0, 2, 3)], 0.3)
    assert isinstance(lost, TransferLost) and (lost.src, lost.tag) == (0, 2)
    assert "timed out" in str(lost) and took < 2.0
    tags = agents.call(0, job_send, gen, [(1, 10, 3), (1, 11, 3)])
    assert tags == [1, 2]
    # a gloo wait that times out would have closed every pair; ours did not
    got = agents.call(1, job_recv, gen, [(0, 1, 3), (0, 2, 3)], 5.0)
    assert torch.equal(got[0], payload(10, 3)) and torch.equal(got[1], payload(11, 3))


def test_q_rows_offload_and_resolve_through_frames(agents: Agents, gen: int) -> None:
    codec = FrameCodec(KEY)
    seeds = [21, 22, 23]
    frame, intact = agents.call(0, job_offload, gen, seeds, 1)
    assert intact
    reply = codec.decode(frame)  # the coordinator's view: references only
    (p0, k0), none_pair, (p1, k1) = reply.value["pairs"]
    p2 = reply.value["lookups"][0].proposal
    assert none_pair == (None, None) and (k0, k1) == (3, 1)
    assert reply.value["point"].q is None
    refs = [p0.q, p1.q, p2.q]
    assert all(isinstance(r, TensorRef) for r in refs)
    assert len({r.segments[0][2] for r in refs}) == 1  # one packed transfer
    want = [payload(s, s % 3 + 2) for s in seeds]
    assert [len(r) for r in refs] == [w.shape[0] for w in want]
    # the coordinator trims and joins speculations without touching a tensor
    items = [
        VerifyItem(step=_step(), proposal=Proposal(tokens=p0.tokens[:2], q=p0.q[:2])),
        VerifyItem(step=_step(), proposal=Proposal(tokens=[9] * 5, q=TensorRef.cat([p1.q[1:], p2.q, p0.q[-1:]]))),
        VerifyItem(step=_step(), proposal=Proposal(tokens=[1], q=None)),
    ]
    (first, still_refs), again, stats = agents.call(1, job_resolve, gen, codec.encode(items))
    expect = [want[0][:2], torch.cat([want[1][1:], want[2], want[0][-1:]]), None]
    for resolved in (first, again):
        for item, e in zip(resolved, expect):
            assert (item.proposal.q is None) if e is None else torch.equal(item.proposal.q, e)
    assert still_refs and stats["pending_recvs"] == 0
    # the sender resolves a reference to its own send (e.g. a BuildItem back to the draft)
    build = [BuildItem(step=_step(), proposal=Proposal(tokens=[1, 2], q=p1.q), fanout=[1, 1, 1], k_next=2)]
    (own, _), _, _ = agents.call(0, job_resolve, gen, codec.encode(build))
    assert torch.equal(own[0].proposal.q, want[1])


def test_discarded_references_release_their_sends_and_threads(agents: Agents, gen: int) -> None:
    """A speculation nobody verifies: its receiver discards it, and the
    sender's pending send and waiter thread are gone (issue 20's T > 0 leak)."""
    _, threads = agents.call(0, job_pending_sends, gen)
    frame, _ = agents.call(0, job_offload, gen, [31, 32, 33], 1)
    stats, during = agents.call(0, job_pending_sends, gen, False)
    assert stats["pending_sends"] == 1 and during == threads + 1  # nobody has taken the packed transfer yet ...
    taken, stats, again = agents.call(1, job_discard, gen, frame)
    assert taken == 1 and stats["pending_recvs"] == 0
    assert torch.equal(again, payload(31, 31 % 3 + 2))  # ... now it sits in the receiver's memo
    stats, after = agents.call(0, job_pending_sends, gen)
    assert stats["pending_sends"] == 0 and after == threads


def test_stale_and_misrouted_references_are_refused(agents: Agents, gen: int) -> None:
    codec = FrameCodec(KEY)
    stale = [VerifyItem(step=_step(), proposal=Proposal(tokens=[1], q=TensorRef(((0, 1, 1, 1, 0, 1),), V, "float32", gen - 1)))]
    with pytest.raises(AssertionError, match="generation"):
        agents.call(1, job_resolve, gen, codec.encode(stale))
    misrouted = [VerifyItem(step=_step(), proposal=Proposal(tokens=[1], q=TensorRef(((0, 2, 1, 1, 0, 1),), V, "float32", gen)))]
    with pytest.raises(AssertionError, match="not to this member"):
        agents.call(1, job_resolve, gen, codec.encode(misrouted))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_delta_round_trip_is_bit_exact(agents: Agents, gen: int, dtype: torch.dtype) -> None:
    frame = agents.call(0, job_send_kv, gen, 5, 3, 4, [1, 2], dtype)
    ref, ext = FrameCodec(KEY).decode(frame)
    assert isinstance(ref, KVDeltaRef) and ref.shape == (3, 2, 4, 2, 4) and [d for d, _ in ref.tags] == [1, 2]
    assert isinstance(ext.kv, KVDeltaRef)
    got = agents.all({1: (job_recv_kv, gen, frame), 2: (job_recv_kv, gen, frame)})
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for kv, ext_kv in got.values():
        for received, seed in ((kv, 5), (ext_kv, 6)):
            want = make_kv(seed, 3, 4, dtype)
            assert len(received) == 3
            for (k, v), (wk, wv) in zip(received, want):
                assert k.dtype == dtype and k.shape == wk.shape
                assert torch.equal(k.view(bits), wk.view(bits)) and torch.equal(v.view(bits), wv.view(bits))


def test_kv_delta_edge_cases(agents: Agents, gen: int) -> None:
    kept, empty, kv = agents.call(0, job_kv_edges, gen)
    assert kept and empty.tags == () and empty.shape == (2, 2, 0, 2, 4)
    assert len(kv) == 2 and all(k.shape == (0, 2, 4) and v.shape == (0, 2, 4) for k, v in kv)


def test_survivors_rebuild_after_a_member_is_killed(agents: Agents, store: DataPlaneStore) -> None:
    g = next(_GEN)
    agents.all({r: (job_join, store.address, r, 3, g) for r in range(3)})
    agents.submit(0, job_recv, g, [(2, 1, 3)], 10.0)  # waits on rank 2 …
    time.sleep(0.3)
    agents.kill(2)  # … which dies without sending
    [(lost, took)] = agents.result(0)
    assert isinstance(lost, TransferLost) and "gone" in str(lost) and took < 5.0
    assert isinstance(agents.call(0, job_send_to_dead, g, 2), TransferLost)
    # what a surviving draft shares after that loses nothing for the living and
    # does not fail: a hit's KV delta goes to rank 1 only, q rows for the dead
    # verifier ride the frame
    frame = agents.call(0, job_send_kv, g, 5, 2, 3, [1, 2], torch.float32)
    ref, ext = FrameCodec(KEY).decode(frame)
    assert [d for d, _ in ref.tags] == [1] and [d for d, _ in ext.kv.tags] == [1]
    kv, ext_kv = agents.call(1, job_recv_kv, g, frame)
    assert all(torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(kv, make_kv(5, 2, 3, torch.float32)))
    assert len(ext_kv) == 2
    with pytest.raises(TransferLost, match="not sent to rank 2"):  # if rank 2's successor were ever handed it
        ref.tag_for(2)
    offloaded, _ = agents.call(0, job_offload, g, [41, 42, 43], 2)
    reply = FrameCodec(KEY).decode(offloaded)
    assert all(isinstance(p.q, torch.Tensor) for p, _ in reply.value["pairs"] if p is not None)
    agents.all({0: (job_abandon, g), 1: (job_abandon, g)})
    agents.start(2)  # the restarted worker
    g2 = next(_GEN)
    agents.all({r: (job_join, store.address, r, 3, g2) for r in range(3)})
    tags = agents.call(2, job_send, g2, [(0, 31, 2), (1, 32, 2)])
    got = agents.all({0: (job_recv, g2, [(2, tags[0], 2)]), 1: (job_recv, g2, [(2, tags[1], 2)])})
    assert torch.equal(got[0][0], payload(31, 2)) and torch.equal(got[1][0], payload(32, 2))
    assert agents.all({r: (job_close, g2) for r in range(3)}) == {0: True, 1: True, 2: True}


def test_every_pair_exchanges_when_the_group_forms(agents: Agents, gen: int) -> None:
    """Formation warms every pair up both ways (on NCCL that creates each
    pair's communicator with both sides posting, instead of a first real send
    creating it lazily under the plane's lock, blocked until its receiver
    posts); then the last rank's first transfer to the first completes
    although rank 0 never sent it anything."""
    formed = agents.all({r: (job_formed, gen) for r in range(3)})
    for r, (backend, note, warmed, stats) in formed.items():
        assert (backend, note) == ("gloo", None)  # a CPU group: gloo is no fallback
        assert sorted(warmed) == [p for p in range(3) if p != r] and stats["warmed_pairs"] == 2
        assert stats["sent"] == stats["received"] == 0  # the warm-up is not a transfer
    [tag] = agents.call(2, job_send, gen, [(0, 41, 2)])
    assert tag == 1  # transfers' tags start after the warm-up's
    [got] = agents.call(0, job_recv, gen, [(2, tag, 2)], 10.0)
    assert torch.equal(got, payload(41, 2))


def test_ranks_sharing_a_gpu_form_a_gloo_group_and_say_why(agents: Agents, store: DataPlaneStore) -> None:
    """Identities published at rendezvous: ranks 0 and 1 claim one GPU, so
    the group cannot be NCCL — every member picks gloo, with the cause."""
    g = next(_GEN)
    gpus = ["GPU-shared", "GPU-shared", "GPU-own"]
    agents.all({r: (job_join, store.address, r, 3, g, 20.0, DeviceIdentity("cuda", gpus[r], True)) for r in range(3)})
    try:
        formed = agents.all({r: (job_formed, g) for r in range(3)})
        assert {f[0] for f in formed.values()} == {"gloo"}
        notes = {f[1] for f in formed.values()}
        assert len(notes) == 1 and "ranks [0, 1] share GPU GPU-shared" in notes.pop()
        [tag] = agents.call(1, job_send, g, [(0, 42, 3)])
        [got] = agents.call(0, job_recv, g, [(1, tag, 3)], 10.0)
        assert torch.equal(got, payload(42, 3))
    finally:
        agents.all({r: (job_abandon, g) for r in range(3)})


def test_an_nccl_receive_out_of_issue_order_is_refused_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """NCCL matches a pair's transfers in issue order: asking for transfer 2
    before 1 would take 1's bytes. The refusal happens before the backend is
    touched (so no group is needed here), and it is counted and logged once
    per pair — the pair's later transfers cannot arrive until a rebuild."""
    plane = DataPlane(None, None, rank=0, world_size=3, generation=7, device=torch.device("cpu"), backend="nccl")
    with caplog.at_level("ERROR", logger="saguaro_ray.runtime.data_plane.group"):
        for tag in (2, 3):
            with pytest.raises(TransferLost, match="tag 1 from rank 1 comes first"):
                plane.prefetch(1, tag, (1, V), torch.float32)
    assert plane.stats()["out_of_order"] == 2 and plane.stats()["pending_recvs"] == 0
    assert [r.getMessage() for r in caplog.records if "issue order" in r.getMessage()] == [
        "data plane generation 7: rank 0 asked rank 1 for transfer 2 before 1; NCCL matches in issue order, "
        "so that pair's later transfers cannot arrive until the group is rebuilt"
    ]


def test_device_strings_get_an_index() -> None:
    """torch.cuda.set_device refuses an index-less "cuda" (torch 2.13): the
    worker's device becomes cuda:N, N the current (Ray-assigned) GPU."""
    assert indexed_device("cuda", current=0) == torch.device("cuda", 0)
    assert indexed_device("cuda", current=3) == torch.device("cuda:3")
    assert indexed_device("cuda:1", current=3) == torch.device("cuda:1")  # an index given stays
    assert indexed_device(torch.device("cpu")) == torch.device("cpu")
    assert indexed_device("cpu", current=2) == torch.device("cpu")


def test_the_backend_follows_the_members_devices() -> None:
    cuda = lambda gpu, nccl=True: DeviceIdentity("cuda", gpu, nccl)  # noqa: E731
    assert choose_backend([cuda("a"), cuda("b"), cuda("c")]) == ("nccl", None)
    assert choose_backend([DeviceIdentity("cpu")] * 3) == ("gloo", None)
    assert choose_backend([cuda("a"), cuda("b")], "gloo") == ("gloo", None)
    backend, why = choose_backend([cuda("a"), cuda("b"), cuda("a")])
    assert backend == "gloo" and "ranks [0, 2] share GPU a" in why
    backend, why = choose_backend([cuda("a"), DeviceIdentity("cpu")])
    assert backend == "gloo" and "ranks [1] are not on a CUDA device" in why
    backend, why = choose_backend([cuda("a"), cuda("b", nccl=False)])
    assert backend == "gloo" and "ranks [1] have no NCCL build" in why
    with pytest.raises(DataPlaneError, match=r"cannot form: ranks \[0, 1\] share GPU a"):
        choose_backend([cuda("a"), cuda("a")], "nccl")
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        choose_backend([cuda("a")], "mpi")
    assert DeviceIdentity.decode(cuda("GPU-1").encode()) == cuda("GPU-1")


def test_the_engine_reports_its_plane_and_why_it_fell_back() -> None:
    """What the coordinator makes of its members' answers: metrics() fields,
    the /health details, and the cause a device check fails on."""
    cpu = PlaneStatus.formed(3, [{"rank": r, "backend": "gloo", "note": None} for r in range(3)])
    assert cpu.metrics() == {"data_plane_backend": "gloo", "data_plane_error": None, "data_plane_generation": 3}
    assert fallback_cause(cpu.metrics()) is None and PlaneStatus.from_metrics(cpu.metrics()) == cpu
    gpu = PlaneStatus.formed(1, [{"backend": "nccl", "note": None}] * 2)
    assert (gpu.backend, fallback_cause(gpu.metrics())) == ("nccl", None)
    _, why = choose_backend([DeviceIdentity("cuda", "GPU-0", True)] * 2)
    shared = PlaneStatus.formed(2, [{"backend": "gloo", "note": why}] * 2)
    assert shared.describe() == {"backend": "gloo", "error": why} and fallback_cause(shared.metrics()) == why
    lost = PlaneStatus.failed(4, JoinTimeout("rank 1 did not join"))
    assert lost.metrics()["data_plane_backend"] == "control" and lost.generation == 0
    assert "generation 4 did not form (JoinTimeout: rank 1 did not join)" in fallback_cause(lost.metrics())
    assert PlaneStatus().metrics() == {"data_plane_backend": "control", "data_plane_error": None, "data_plane_generation": 0}  # off on purpose
    # said once: at start-up, not again when a rebuild falls back for the same cause
    assert shared.announcement(PlaneStatus()) == f"data plane: {why} (see metrics()['data_plane_error'])"
    again = PlaneStatus.formed(3, [{"backend": "gloo", "note": why}] * 2)
    assert again.announcement(shared) is None and cpu.announcement(PlaneStatus()) is None
    assert lost.announcement(shared) is not None  # a new cause is news


def test_join_timeout_names_the_missing_ranks(store: DataPlaneStore) -> None:
    t0 = time.monotonic()
    with pytest.raises(JoinTimeout, match=r"only 1 of 3 members joined \(missing ranks \[0, 2\]\)"):
        DataPlane.join(store.address, KEY, 1, 3, 900, timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(DataPlaneError, match="new generation"):
        DataPlane.join(store.address, KEY, 1, 3, 900, timeout_s=0.5)


def test_join_to_nothing_is_a_clear_error() -> None:
    with pytest.raises(JoinTimeout, match="cannot reach the rendezvous store"):
        DataPlane.join("tcp://127.0.0.1:1", KEY, 0, 2, 0, timeout_s=0.5)


# ---------------------------------------------------------------- descriptors (no group needed)


def test_tensor_ref_slicing_and_cat() -> None:
    r = TensorRef(((0, 1, 5, 10, 2, 3), (2, 1, 7, 4, 0, 4)), 16, "float32", 3)
    assert len(r) == 7 and r.shape == (7, 16)
    assert r[:4].segments == ((0, 1, 5, 10, 2, 3), (2, 1, 7, 4, 0, 1))
    assert r[1:6].segments == ((0, 1, 5, 10, 3, 2), (2, 1, 7, 4, 0, 3))
    assert r[:0].segments == () and len(r[:0]) == 0 and r[-2:] == r[5:]
    assert TensorRef.cat([r[:2], r[2:5], r[5:]]) == r  # adjacent rows merge back
    with pytest.raises(ValueError):
        TensorRef(((0, 1, 5, 3, 2, 3),), 16, "float32", 0)  # rows past the transfer
    with pytest.raises(ValueError):
        TensorRef.cat([r, TensorRef((), 8, "float32", 3)])


def test_refs_survive_the_frame_codec() -> None:
    codec = FrameCodec(new_key())
    r = TensorRef(((0, 1, 5, 10, 2, 3),), 16, "bfloat16", 2)
    k = KVDeltaRef(0, ((1, 4), (2, 4)), (2, 2, 3, 4, 5), "float16", 2)
    back = codec.decode(codec.encode({"q": r, "kv": k, "items": [VerifyItem(step=_step(), proposal=Proposal([1, 2, 3], q=r))]}))
    assert back["q"] == r and back["kv"] == k and back["items"][0].proposal.q == r
    assert hash(back["q"]) == hash(r)


def test_one_transfer_lost_for_the_data_plane_and_the_round_loop() -> None:
    """The data plane raises the very class the round loop retries on (there
    were two, a subclass carrying the transfer and its base); it keeps the
    transfer through pickling, and a worker's error that crossed the control
    plane as type name and message alone rebuilds as the same class."""
    import pickle

    from saguaro_ray import errors
    from saguaro_ray.engine import transport

    assert TransferLost is transport.TransferLost is errors.TransferLost
    lost = TransferLost.for_transfer(3, 7, "timed out")
    again = pickle.loads(pickle.dumps(lost))
    assert (type(again), again.src, again.tag, str(again)) == (TransferLost, 3, 7, str(lost))
    remote = TransferLost(str(lost))  # what a CommandClient builds from an error reply
    assert (remote.src, remote.tag, str(remote)) == (None, None, str(lost))

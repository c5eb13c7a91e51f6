"""ZeroMQ control plane: command calls to a worker in another process, and the broadcast.

Loopback TCP (127.0.0.1) and ipc only; every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from saguaro_ray.config import SamplingParams
from saguaro_ray.runtime.control import (
    Broadcaster,
    CallForwarder,
    ClientClosed,
    CommandClient,
    CommandServer,
    ControlError,
    RemoteError,
    Subscriber,
    SubscriberTimeout,
    WorkerTimeout,
    bind_endpoint,
    release_endpoint,
)
from saguaro_ray.runtime.control.clock import ClockMap
from saguaro_ray.runtime.replay import Sender
from saguaro_ray.runtime.wire import EncodeError, FrameCodec, new_key
from saguaro_ray.workers.messages import NeedsPrefillError, Outcome, Proposal, SeqStep, Timed, VerifyItem

ALLOWED = ["add", "history", "echo", "boom", "needs_prefill", "sleep", "pid", "verify", "unsendable"]


class Recorder:
    """The worker object served by the child process."""

    def __init__(self) -> None:
        self.logs: dict[str, list] = {}

    def add(self, tag: str, x):
        log = self.logs.setdefault(tag, [])
        log.append(x)
        return len(log)

    def history(self, tag: str):
        return list(self.logs.get(tag, []))

    def echo(self, *args):
        return args

    def boom(self, msg: str):
        raise KeyError(msg)

    def needs_prefill(self, msg: str):
        raise NeedsPrefillError(msg)

    def sleep(self, s: float):
        time.sleep(s)
        return s

    def pid(self):
        return os.getpid()

    def verify(self, items: list[VerifyItem]) -> list[Outcome]:
        assert all(isinstance(it, VerifyItem) for it in items)
        return [Outcome(it.step.seq_id, len(it.proposal.tokens), int(it.proposal.q[-1].argmax()) if it.proposal.q is not None else -1, len(it.proposal.tokens)) for it in items]

    def unsendable(self):
        return {1, 2}

    def secret(self):
        return "never served"


def _serve_in_child(key: bytes, conn) -> None:
    servers = {
        "tcp": CommandServer(Recorder(), ALLOWED, key, host="127.0.0.1", name="tcp"),
        "ipc": CommandServer(Recorder(), ALLOWED, key, host=None, name="ipc"),
        "slow": CommandServer(Recorder(), ALLOWED, key, host="127.0.0.1", name="slow"),
    }
    conn.send({name: s.endpoint for name, s in servers.items()})
    deadline = time.monotonic() + 300  # never outlive a stuck test run
    while time.monotonic() < deadline and not conn.poll(0.1):
        pass
    for s in servers.values():
        s.close(timeout_s=2.0)


@pytest.fixture(scope="module")
def worker():
    key = new_key()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_child, args=(key, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(90), "worker process did not start"
        endpoints = parent.recv()
        yield key, endpoints, proc
    finally:
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.fixture(params=["tcp", "ipc"])
def client(request, worker):
    key, endpoints, _ = worker
    c = CommandClient(request.param, endpoints[request.param], key, timeout_s=20)
    yield c
    c.close()


def step(seq_id: int) -> SeqStep:
    return SeqStep(seq_id, 0, [1, 2, 3], SamplingParams(temperature=0.5, seed=3), seed=7, output_pos=0)


# ---------------------------------------------------------------- commands


def test_calls_roundtrip(client, worker):
    assert client.endpoint.startswith(client.name)
    assert client.ping() > 0
    pid = client.submit("pid").result(10)
    assert isinstance(pid, Timed) and pid.value == worker[2].pid != os.getpid()
    assert isinstance(pid.start, float) and pid.start <= pid.end
    assert client.call("echo", 1, (2, (3, 4)), "x", None, b"\x00") == (1, (2, (3, 4)), "x", None, b"\x00")
    q = torch.zeros(2, 9, dtype=torch.bfloat16)
    q[1, 5] = 1
    items = [VerifyItem(step(0), Proposal([4, 5], q)), VerifyItem(step(1), Proposal([], None))]
    assert client.call("verify", items) == [Outcome(0, 2, 5, 2), Outcome(1, 0, -1, 0)]


def test_calls_run_in_arrival_order(client):
    tag = uuid.uuid4().hex
    futures = [client.submit("add", tag, i) for i in range(100)]
    assert [f.result(20).value for f in futures] == list(range(1, 101))
    assert client.call("history", tag) == list(range(100))


def test_concurrent_submits_from_threads(client):
    tag = uuid.uuid4().hex
    results: dict[int, list] = {}

    def run(t: int) -> None:
        futs = [(i, client.submit("echo", t, i), client.submit("add", tag, (t, i))) for i in range(30)]
        results[t] = [(i, fe.result(20).value, fa.result(20).value) for i, fe, fa in futs]

    threads = [threading.Thread(target=run, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(results) == list(range(6))
    for t, rows in results.items():
        assert [echo for _, echo, _ in rows] == [(t, i) for i in range(30)]
    lengths = sorted(n for rows in results.values() for _, _, n in rows)
    assert lengths == list(range(1, 181))  # every add ran exactly once
    history = client.call("history", tag)
    for t in range(6):  # each thread's calls ran in its submission order
        assert [i for tt, i in history if tt == t] == list(range(30))


def test_remote_exception_and_disallowed_methods(client):
    with pytest.raises(RemoteError) as info:
        client.submit("boom", "no such sequence").result(10)
    assert info.value.type_name == "KeyError" and "no such sequence" in info.value.message
    assert info.value.worker == client.name and "boom" in info.value.remote_traceback
    for method in ["secret", "__init__", "_private", "missing"]:
        with pytest.raises(RemoteError) as info:
            client.submit(method).result(10)
        assert info.value.type_name == "MethodNotAllowed"
    with pytest.raises(RemoteError) as info:
        client.submit("unsendable").result(10)  # the result cannot be encoded
    assert info.value.type_name == "EncodeError"
    with pytest.raises(EncodeError):
        client.submit("echo", object())  # rejected before sending
    assert client.call("echo", 1) == (1,)  # still serving


def test_project_errors_are_raised_as_local_types(worker):
    """A worker's exception of a project type is raised as that type (the
    errors module's one registry; it used to be a by-name map per client)."""
    key, endpoints, _ = worker
    with CommandClient("tcp", endpoints["tcp"], key, timeout_s=20) as c:
        with pytest.raises(NeedsPrefillError) as info:
            c.submit("needs_prefill", "seq 4").result(10)
        assert isinstance(info.value.__cause__, RemoteError) and info.value.__cause__.type_name == "NeedsPrefillError"
        assert str(info.value) == "seq 4"
        with pytest.raises(TypeError):
            c.submit(3)  # type: ignore[arg-type]


def test_timeout_fails_the_future_and_close_is_prompt(worker):
    key, endpoints, _ = worker
    with CommandClient("slow", endpoints["slow"], key, timeout_s=0.25) as c:
        c.ping()
        t0 = time.monotonic()
        slow = c.submit("sleep", 0.6)
        with pytest.raises(WorkerTimeout):
            slow.result(5)
        # (a WorkerTimeout, not the value: it failed before the reply came)
        after = c.submit_with("sleep", (0.0,), timeout_s=10)
        assert after.result(10).value == 0.0
        assert c.late_replies == 1  # the timed-out call's reply was discarded
    c = CommandClient("slow", endpoints["slow"], key, timeout_s=30)
    pending = c.submit("sleep", 0.5)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(ClientClosed):
        pending.result(1)
    with pytest.raises(ClientClosed):
        c.submit("pid")
    c.close()  # idempotent


def test_forged_frames_are_dropped_and_counted(worker):
    key, endpoints, _ = worker
    codec = FrameCodec(key)
    with CommandClient("tcp", endpoints["tcp"], key, timeout_s=20) as c:
        before = c.server_stats()
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(endpoints["tcp"])
        try:
            request = {"id": 1, "method": "add", "args": ["forged", 1]}
            raw.send(b"garbage bytes")  # bad mac
            raw.send(FrameCodec(b"w" * 32).encode(request))  # bad mac: wrong key
            raw.send_multipart([codec.encode(request), b"x"])  # malformed: extra part
            raw.send(codec.encode(["not", "a", "request"]))  # malformed
            raw.send(codec.seal(msgpack.packb([msgpack.ExtType(2, b"Evil")])))  # unknown type
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stats = c.server_stats()
                if stats["dropped"] - before["dropped"] >= 5:
                    break
                time.sleep(0.02)
            reasons = stats["drop_reasons"]
            got = {r: reasons.get(r, 0) - before["drop_reasons"].get(r, 0) for r in ("bad mac", "malformed", "unknown type")}
            assert got == {"bad mac": 2, "malformed": 2, "unknown type": 1}
            assert raw.poll(200) == 0  # nothing was answered
            assert c.call("history", "forged") == []  # nothing was acted on
            assert c.call("echo", "alive") == ("alive",)
        finally:
            raw.close(0)


def test_client_drops_forged_replies():
    key = new_key()
    codec = FrameCodec(key)
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    endpoint = bind_endpoint(rogue, "127.0.0.1")
    try:
        with CommandClient("rogue", endpoint, key, timeout_s=10) as c:
            fut = c.submit("pid")
            assert rogue.poll(5000)
            ident, frame = rogue.recv_multipart()
            hello = codec.decode(frame)
            assert hello["method"] == "__hello__"  # the handshake comes first; the call waits for its answer
            assert not rogue.poll(200)
            me = Sender()
            rogue.send_multipart([ident, codec.encode({"id": 999, "ok": True, "result": Timed(None, 0.0, 1.0)}, me.stamp(ident))])
            answer = codec.encode({"id": hello["id"], "ok": True, "result": Timed(None, 0.0, 1.0)}, me.stamp(ident))
            rogue.send_multipart([ident, answer])
            assert rogue.poll(5000)
            ident, frame = rogue.recv_multipart()
            stamp, payload = codec.unseal(frame)
            req = codec.decode(frame)
            assert req["method"] == "pid" and req["args"] == [] and stamp.to == me.id and c.server_id == me.id
            rogue.send_multipart([ident, b"junk"])
            rogue.send_multipart([ident, FrameCodec(b"w" * 32).encode({"id": req["id"], "ok": True, "result": Timed(666, 0.0, 1.0)}, me.stamp(ident))])
            rogue.send_multipart([ident, codec.encode({"id": 10**6, "ok": True, "result": Timed(1, 0.0, 1.0)}, me.stamp(ident))])
            rogue.send_multipart([ident, codec.encode({"id": req["id"], "ok": True, "result": Timed(7, 1.0, 2.0)}, Sender().stamp(ident))])  # not the server
            rogue.send_multipart([ident, codec.encode({"id": req["id"], "ok": True, "result": Timed(8, 1.0, 2.0)}, me.stamp(b"rx-other"))])
            rogue.send_multipart([ident, answer])  # the handshake's answer again
            rogue.send_multipart([ident, codec.encode({"id": req["id"], "ok": True, "result": Timed(42, 1.0, 2.0)}, me.stamp(ident))])
            assert fut.result(5).value == 42
            assert c.drop_reasons == {"bad mac": 2, "misaddressed": 3, "replayed": 1}
            assert c.late_replies == 1
    finally:
        rogue.close(0)


def test_server_in_process_and_validation():
    key = new_key()
    with pytest.raises(ValueError):
        CommandServer(Recorder(), ["_private"], key)
    with pytest.raises(ValueError):
        CommandServer(Recorder(), ["missing"], key)
    server = CommandServer(Recorder(), ["echo"], key, host=None, name="local")
    path = server.endpoint[len("ipc://") :]
    assert os.path.exists(path)
    with CommandClient("local", server.endpoint, key, timeout_s=10) as c:
        assert c.call("echo", {"k": (1, 2)}) == ({"k": (1, 2)},)
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 1.5
    assert not os.path.exists(os.path.dirname(path))
    server.close()
    assert server.stats()["calls"] == 1


def test_bind_endpoint_helpers():
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    tcp = bind_endpoint(s, "127.0.0.1")
    assert tcp.startswith("tcp://127.0.0.1:") and int(tcp.rsplit(":", 1)[1]) > 0
    ipc = bind_endpoint(s, None, name="probe")
    assert ipc.startswith("ipc://") and ipc.endswith("probe.sock") and os.path.exists(ipc[6:])
    assert oct(os.stat(os.path.dirname(ipc[6:])).st_mode & 0o777) == "0o700"
    s.close(0)
    release_endpoint(ipc)
    release_endpoint(tcp)
    assert not os.path.exists(os.path.dirname(ipc[6:]))
    with pytest.raises(ValueError):
        bind_endpoint(s, "tcp://x")


def test_clock_map_keeps_the_tightest_sample():
    m = ClockMap()
    # worker clock = local + 100; a call that ran 1.0-1.5 locally, sent at 0.9, answered at 1.6
    m.sample(0.9, 1.6, 101.0, 101.5)
    assert abs(m.offset - 100.0) < 1e-9
    # a queued call (long wait before it started) gives a loose sample that must not win
    m.sample(2.0, 5.0, 104.5, 104.9)
    assert abs(m.offset - 100.0) < 1e-9
    mapped = m.map(Timed("v", 110.0, 111.0))
    assert (mapped.value, mapped.start, mapped.end) == ("v", 10.0, 11.0)


# ---------------------------------------------------------------- broadcast


@pytest.mark.parametrize("host", ["127.0.0.1", None])
def test_first_broadcast_reaches_every_subscriber(host):
    key = new_key()
    with Broadcaster(key, host=host) as b:
        subs = [Subscriber(b.invitation(), key, name=f"s{i}") for i in range(4)]
        only_a = Subscriber(b.invitation(), key, topics=["a"])
        try:
            assert b.wait_for_subscribers(5, timeout_s=10) == 5
            first = [Outcome(1, 2, 3), (4, Proposal([5], torch.ones(1, 3)))]
            b.publish(first)  # immediately: no sleep, no retry
            for i in range(3):
                b.publish(i, topic="a" if i == 1 else "b")
            for s in subs:
                got = s.recv(timeout_s=5)
                assert got[0] == Outcome(1, 2, 3) and got[1][0] == 4 and torch.equal(got[1][1].q, torch.ones(1, 3))
                assert [s.recv(5) for _ in range(3)] == [0, 1, 2]
                assert s.dropped_frames == 0
            assert only_a.recv(5) == 1
            assert only_a.recv(0.1) is None
        finally:
            for s in subs + [only_a]:
                s.close()
        deadline = time.monotonic() + 5
        while b.subscribers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.subscribers == 0  # leaving is noticed


def test_wait_for_subscribers_times_out():
    key = new_key()
    with Broadcaster(key, host="127.0.0.1") as b:
        t0 = time.monotonic()
        with pytest.raises(SubscriberTimeout):
            b.wait_for_subscribers(1, timeout_s=0.2)
        assert time.monotonic() - t0 < 1.5
        with Subscriber(b.invitation(), b"w" * 32) as wrong:
            with pytest.raises(SubscriberTimeout):
                b.wait_for_subscribers(1, timeout_s=0.3)
            b.publish("secret")
            assert wrong.recv(0.2) is None  # never subscribed
        assert b.drop_reasons.get("bad mac") == 1


def test_forged_subscribers_get_nothing():
    key = new_key()
    codec = FrameCodec(key)
    with Broadcaster(key, host="127.0.0.1") as b:
        raw = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SUBSCRIBE, b"")  # tries to get everything
        raw.setsockopt(zmq.SUBSCRIBE, b"Hforged hello")
        raw.setsockopt(zmq.SUBSCRIBE, b"H" + codec.encode(["not a hello"]))
        raw.setsockopt(zmq.SUBSCRIBE, b"X")
        raw.connect(b.endpoint)
        try:
            with Subscriber(b.invitation(), key) as good:
                b.wait_for_subscribers(1, timeout_s=10)
                deadline = time.monotonic() + 5
                while b.dropped_frames < 4 and time.monotonic() < deadline:
                    b.subscribers
                    time.sleep(0.01)
                assert b.drop_reasons == {"bad mac": 1, "malformed": 3}  # b"", bad hello, non-dict hello, b"X"
                assert b.subscribers == 1
                b.publish({"x": 1})
                assert good.recv(5) == {"x": 1}
                assert raw.poll(300) == 0
        finally:
            raw.close(0)


def test_subscriber_drops_forged_broadcasts():
    key = new_key()
    codec = FrameCodec(key)
    rogue = zmq.Context.instance().socket(zmq.XPUB)
    rogue.setsockopt(zmq.LINGER, 0)
    endpoint = bind_endpoint(rogue, None)
    pub = Sender()  # the broadcaster the subscriber is introduced to
    try:
        with Subscriber([endpoint, pub.id, 0], key) as sub:
            deadline = time.monotonic() + 5
            seen = set()
            while b"\x01D" not in seen and time.monotonic() < deadline:  # the SUB's filter arrived
                if rogue.poll(100):
                    seen.add(rogue.recv())
            rogue.send_multipart([b"D", b"garbage"])
            rogue.send_multipart([b"D", FrameCodec(b"w" * 32).encode({"topic": "", "msg": "evil"}, pub.stamp())])
            rogue.send_multipart([b"D", codec.encode(["no envelope"], pub.stamp())])
            rogue.send_multipart([b"Dother", codec.encode({"topic": "", "msg": "retopiced"}, pub.stamp())])
            rogue.send_multipart([b"D", b"a", b"b"])
            rogue.send_multipart([b"D", codec.encode({"topic": "", "msg": "stranger"}, Sender().stamp())])  # another sender
            ok = codec.encode({"topic": "", "msg": "ok"}, pub.stamp())
            rogue.send_multipart([b"D", ok])
            assert sub.recv(5) == "ok"
            rogue.send_multipart([b"D", ok])  # the same frame again
            assert sub.recv(0.3) is None
            assert sub.drop_reasons == {"bad mac": 2, "malformed": 3, "misaddressed": 1, "replayed": 1}
    finally:
        rogue.close(0)
        release_endpoint(endpoint)


def test_subscriber_close_interrupts_recv():
    key = new_key()
    with Broadcaster(key, host=None) as b:
        sub = Subscriber(b.invitation(), key)
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                sub.recv(timeout_s=30)
            except ControlError as e:
                errors.append(e)

        th = threading.Thread(target=reader)
        th.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        sub.close()
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t0 < 1.5
        assert len(errors) == 1


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_broadcast_calls_reach_each_addressed_server_once(host):
    """One XPUB message carries a call to several servers; each answers its
    own entry to the client named there, in order with its direct calls;
    servers not addressed ignore it; malformed entries are dropped."""
    key = new_key()
    workers = {n: Recorder() for n in ("d0", "d1", "d2")}
    servers = {n: CommandServer(w, ALLOWED, key, host=host, name=n) for n, w in workers.items()}
    clients = {n: CommandClient(n, s.endpoint, key, timeout_s=20) for n, s in servers.items()}
    bus = Broadcaster(key, host=host)
    try:
        ids = [c.call("__subscribe__", bus.invitation()) for c in clients.values()]
        bus.wait_for(ids, timeout_s=20)
        clients["d0"].call("add", "t", "direct")
        calls, futs = {}, {}
        for n in ("d0", "d1"):  # d2 is not addressed
            cid, futs[n] = clients[n].expect("add")
            calls[n] = [clients[n].identity, cid]
        bus.publish({"method": "add", "args": ["t", "bcast"], "calls": calls})
        assert futs["d0"].result(20).value == 2 and futs["d1"].result(20).value == 1
        bus.publish({"method": "add", "args": ["t", "x"], "calls": {"d2": ["not-bytes", 1]}})  # malformed entry
        bus.publish({"method": "add", "calls": calls})  # no args: malformed
        assert clients["d0"].call("history", "t") == ["direct", "bcast"]
        assert clients["d2"].call("history", "t") == []
        # everyone drops the argless call; only d2 is named by the bad entry (a direct
        # call that arrives while a broadcast waits runs first, so wait for the drops)
        deadline = time.monotonic() + 20
        while servers["d0"].drop_reasons.get("malformed", 0) < 1 or servers["d2"].drop_reasons.get("malformed", 0) < 2:
            assert time.monotonic() < deadline, (servers["d0"].drop_reasons, servers["d2"].drop_reasons)
            time.sleep(0.01)
        assert servers["d0"].drop_reasons.get("malformed", 0) == 1 and servers["d2"].drop_reasons.get("malformed", 0) == 2
        assert servers["d0"].stats()["broadcast_calls"] == 1 and servers["d2"].stats()["broadcast_calls"] == 0
    finally:
        bus.close()
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.close()


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_direct_calls_that_arrived_first_run_before_a_broadcast(host):
    """An SSD lookup is broadcast after that round's build was sent directly;
    when both are waiting for a busy server, the build (sent first) must run
    first, whichever socket the server happens to look at first."""
    key = new_key()
    server = CommandServer(Recorder(), ALLOWED, key, host=host, name="d0")
    client = CommandClient("d0", server.endpoint, key, timeout_s=20)
    bus = Broadcaster(key, host=host)
    try:
        bus.wait_for([client.call("__subscribe__", bus.invitation())], timeout_s=20)
        busy = client.submit("sleep", 0.5)  # both calls below queue up behind it
        time.sleep(0.1)
        direct = client.submit("add", "t", "direct")
        time.sleep(0.05)
        cid, bcast = client.expect("add")
        bus.publish({"method": "add", "args": ["t", "bcast"], "calls": {"d0": [client.identity, cid]}})
        busy.result(20), direct.result(20), bcast.result(20)
        assert client.call("history", "t") == ["direct", "bcast"]
    finally:
        bus.close()
        client.close()
        server.close()


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_a_forwarded_call_is_answered_to_the_client_that_expects_it(host):
    """A worker places a call on another worker for the coordinator (the SSD
    target starting the drafts' lookups): the peer answers the coordinator."""
    key = new_key()
    peer = CommandServer(Recorder(), ALLOWED, key, host=host, name="draft")
    client = CommandClient("draft", peer.endpoint, key, timeout_s=20)
    forwarder = CallForwarder(key)
    try:
        client.call("add", "t", "first")  # the peer knows the client's reply socket
        cid, fut = client.expect("add")
        forwarder.call(client.address_for(cid), "add", ["t", "forwarded"])
        assert fut.result(20).value == 2 and forwarder.forwarded == 1
        assert client.call("history", "t") == ["first", "forwarded"]
        # a withdrawn call fails at once; an answer that still comes counts as late
        cid, fut = client.expect("add")
        client.forget(cid)
        with pytest.raises(ControlError, match="withdrawn"):
            fut.result(1)
        forwarder.call(client.address_for(cid), "add", ["t", "late"])
        deadline = time.monotonic() + 20
        while client.late_replies == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ControlError):
            forwarder.call([peer.endpoint, peer.id, "not bytes", cid], "add", ["t", "x"])
        with pytest.raises(ControlError, match="no server id"):  # a client that has not reached its server yet
            forwarder.call([peer.endpoint, None, client.identity, cid], "add", ["t", "x"])
        for _ in range(2):  # a bad endpoint is refused each time, and no socket is kept for it
            with pytest.raises(ControlError, match="cannot forward"):
                forwarder.call(["bogus://nowhere", peer.id, client.identity, cid], "add", ["t", "x"])
        assert "bogus://nowhere" not in forwarder._socks
        # a verification whose lookup cannot be placed still stands (that lookup is lost)
        from saguaro_ray.runtime.routing import ActorLogic

        routed = ActorLogic(Recorder(), key, forwarder=forwarder)
        item = VerifyItem(SeqStep(1, 0, [5], SamplingParams(), 0, 0, []), Proposal([7], torch.eye(4)[[2]]))
        forward = {"method": "echo", "args": ["more"], "to": [["bogus://nowhere", peer.id, client.identity, 99]]}
        assert routed.verify([item], forward) == [Outcome(1, 1, 2, 1)]
        cid, fut = client.expect("echo")
        forward["to"] = [client.address_for(cid)]
        routed.verify([item], forward)
        assert list(fut.result(20).value) == [[(1, 1, 2)], "more"]  # the outcomes' keys, then the given args
    finally:
        forwarder.close()
        client.close()
        peer.close()


class Rounds:
    """A draft in miniature: a lookup needs the build of its round."""

    def __init__(self) -> None:
        self.built: int | None = None
        self.order: list[str] = []

    def build(self, r: int) -> None:
        self.built = r
        self.order.append(f"build {r}")

    def lookup(self, r: int) -> bool:
        self.order.append(f"lookup {r}")
        return self.built == r

    def history(self) -> list[str]:
        return list(self.order)


def test_a_call_that_is_not_ready_waits_for_the_call_that_readies_it():
    """A forwarded lookup may overtake its round's build (another connection):
    it waits while later calls run, and runs once the build has; with no build
    coming it runs when its time is up."""
    key = new_key()
    logic = Rounds()
    ready = lambda method, args: method != "lookup" or (logic.built is not None and logic.built >= args[0])  # noqa: E731
    server = CommandServer(logic, ["build", "lookup", "history"], key, name="d", ready=ready, max_defer_s=0.5)
    coordinator = CommandClient("d", server.endpoint, key, timeout_s=20)
    target = CommandClient("d", server.endpoint, key, timeout_s=20)  # another connection
    try:
        early = target.submit("lookup", 1)  # overtakes the build
        time.sleep(0.1)
        assert not early.done()
        coordinator.call("build", 1)
        assert early.result(20).value is True
        t0 = time.monotonic()
        assert target.call("lookup", 2) is False  # no build 2 comes: a miss, after the wait
        waited = time.monotonic() - t0
        assert waited >= 0.4, waited
        assert coordinator.call("history") == ["build 1", "lookup 1", "lookup 2"]
        assert coordinator.server_stats()["deferred_calls"] == 2
    finally:
        coordinator.close()
        target.close()
        server.close()


# ---------------------------------------------------------------- replays


class Tap:
    """A man in the middle on a real socket: clients connect here, every frame
    is passed on to ``upstream`` (one DEALER per client connection, under that
    connection's routing id, so replies find their way back) and kept. With
    ``replay_verifies``, each ``verify`` call is also sent again that many
    times from another connection right after it passed (the attack of
    issue 20)."""

    def __init__(self, upstream: str, key: bytes, replay_verifies: int = 0) -> None:
        self.upstream = upstream
        self._codec = FrameCodec(key)
        self._replays = replay_verifies
        self.frames: list[bytes] = []
        self.replayed = 0
        self.front = zmq.Context.instance().socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind_endpoint(self.front, "127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(self.upstream)
        backs: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(20):
                    if sock is self.front:
                        ident, frame = self.front.recv_multipart()
                        back = backs.get(ident)
                        if back is None:
                            back = backs[ident] = ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.setsockopt(zmq.ROUTING_ID, ident)
                            back.connect(self.upstream)
                            poller.register(back, zmq.POLLIN)
                        self.frames.append(frame)
                        back.send(frame)
                        if self._replays and self._codec.decode(frame)["method"] == "verify":
                            for _ in range(self._replays):
                                attacker.send(frame)
                                self.replayed += 1
                    else:
                        self.front.send_multipart([sock.getsockopt(zmq.ROUTING_ID), sock.recv()])
        finally:
            for s in [attacker, *backs.values()]:
                s.close(0)

    def captured(self, method: str) -> list[bytes]:
        return [f for f in self.frames if self._codec.decode(f)["method"] == method]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)


def _wait_for(done: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_captured_call_sent_again_is_dropped_and_counted():
    """A frame captured off the wire and sent again — on any connection, to the
    same server or to its restarted successor — is never executed."""
    key = new_key()
    logic = Recorder()
    server = CommandServer(logic, ALLOWED, key, host="127.0.0.1", name="w")
    tap = Tap(server.endpoint, key)
    client = CommandClient("w", tap.endpoint, key, timeout_s=20)
    attacker = zmq.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(server.endpoint)
    restarted = None
    try:
        assert [client.call("add", "t", i) for i in range(3)] == [1, 2, 3]
        adds = tap.captured("add")
        assert len(adds) == 3 and client.server_id == server.id
        for f in adds:
            attacker.send(f)
        _wait_for(lambda: server.drop_reasons.get("replayed", 0) == 3, f"replays not counted: {server.drop_reasons}")
        assert logic.history("t") == [0, 1, 2]  # state unchanged
        assert not attacker.poll(200)  # and nothing answered
        # the worker restarts (a new server, a new id): the old frames are for its predecessor
        restarted = CommandServer(Recorder(), ALLOWED, key, host="127.0.0.1", name="w")
        attacker.disconnect(server.endpoint)
        attacker.connect(restarted.endpoint)
        for f in adds:
            attacker.send(f)
        _wait_for(lambda: restarted.drop_reasons.get("misaddressed", 0) == 3, f"old frames accepted: {restarted.drop_reasons}")
        # a new client (the coordinator reconnecting) is served at once
        with CommandClient("w", restarted.endpoint, key, timeout_s=20) as again:
            assert again.call("add", "t", "new") == 1
            assert again.call("history", "t") == ["new"]
        assert client.call("add", "t", 3) == 4  # the first client was never disturbed
        assert server.stats()["calls"] == 4 and server.dropped_frames == 3
    finally:
        attacker.close(0)
        client.close()
        tap.close()
        server.close()
        if restarted is not None:
            restarted.close()


def test_a_captured_forwarded_call_sent_again_is_dropped():
    """A call the target forwards to a draft for the coordinator, captured and
    sent again, is not executed a second time."""
    key = new_key()
    logic = Recorder()
    peer = CommandServer(logic, ALLOWED, key, host="127.0.0.1", name="draft")
    client = CommandClient("draft", peer.endpoint, key, timeout_s=20)
    forwarder = CallForwarder(key)
    tap = Tap(peer.endpoint, key)
    attacker = zmq.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(peer.endpoint)
    try:
        client.call("add", "t", "first")
        cid, fut = client.expect("add")
        address = client.address_for(cid)
        address[0] = tap.endpoint  # the forwarded call passes the tap
        forwarder.call(address, "add", ["t", "forwarded"])
        assert fut.result(20).value == 2
        [frame] = tap.captured("add")
        attacker.send(frame)
        _wait_for(lambda: peer.drop_reasons.get("replayed", 0) == 1, f"replay not counted: {peer.drop_reasons}")
        assert client.call("history", "t") == ["first", "forwarded"]
        assert client.late_replies == 0  # nothing was answered for it either
    finally:
        attacker.close(0)
        tap.close()
        forwarder.close()
        client.close()
        peer.close()


def test_a_captured_broadcast_sent_again_is_dropped():
    """The outcome broadcast: a message re-published is dropped by the
    subscriber as a replay; one published before it was invited, too."""
    key = new_key()
    logic = Recorder()
    server = CommandServer(logic, ALLOWED, key, host=None, name="d0")
    client = CommandClient("d0", server.endpoint, key, timeout_s=20)
    bus = Broadcaster(key, host=None)
    spy = Subscriber(bus.invitation(), key)  # sees what the worker sees
    try:
        bus.wait_for([spy.id], timeout_s=20)
        cid, fut = client.expect("add")
        bus.publish({"method": "add", "args": ["t", "before"], "calls": {}})
        assert spy._sock.poll(5000)
        early = spy._sock.recv_multipart()  # a message from before the worker's invitation
        bus.wait_for([client.call("__subscribe__", bus.invitation())], timeout_s=20)
        bus.publish({"method": "add", "args": ["t", "bcast"], "calls": {"d0": [client.identity, cid]}})
        assert fut.result(20).value == 1
        assert spy._sock.poll(5000)
        captured = spy._sock.recv_multipart()
        with bus._lock:  # an attacker with the broadcaster's socket in hand
            bus._sock.send_multipart(captured)
            bus._sock.send_multipart(early)
        _wait_for(lambda: server.drop_reasons.get("replayed", 0) == 2, f"replays not counted: {server.drop_reasons}")
        assert client.call("history", "t") == ["bcast"]
        assert server.stats()["broadcast_calls"] == 1
    finally:
        spy.close()
        bus.close()
        client.close()
        server.close()


def test_replayed_verifications_during_sd_leave_the_output_exact(tmp_path):
    """Issue 20: replayed verification frames rolled back the target's KV and
    changed SD's T = 0 output. An SD run over the real control plane with every
    verification sent again three times from another connection stays token
    for token equal to AR, and the target counts every replay."""
    from helpers import save_tiny_checkpoint

    from saguaro_ray.config import SpeculationConfig
    from saguaro_ray.engine import LocalEngine
    from saguaro_ray.runtime.engine_config import EngineConfig
    from saguaro_ray.engine.frontend import Frontend
    from saguaro_ray.model_set import ModelSet
    from saguaro_ray.engine.round_loop import RoundLoop
    from saguaro_ray.engine.scheduler import Scheduler
    from saguaro_ray.workers.draft import DraftLogic
    from saguaro_ray.workers.runner import ModelRunner
    from saguaro_ray.workers.target import TargetLogic

    target = str(save_tiny_checkpoint(tmp_path, "llama", seed=0))
    draft = str(save_tiny_checkpoint(tmp_path, "qwen3", seed=7))  # unrelated weights: many rejections
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [[3, 5, 7, 9], [1, 2], [10, 20, 30, 40]]
    ar = LocalEngine(EngineConfig(target=target, threads_per_worker=1))
    try:
        expected = [r.token_ids for r in ar.generate(prompts, params)]
    finally:
        ar.close()
    key = new_key()
    models = ModelSet.from_specs({"target": target, "draft": draft})
    ckpts, tokenizer = models.checkpoints, models.tokenizer
    runners = {role: ModelRunner(ck) for role, ck in ckpts.items()}
    servers = {
        "target": CommandServer(TargetLogic(runners["target"]), ["verify", "prefill", "release"], key, host="127.0.0.1", name="target"),
        "draft0": CommandServer(DraftLogic(runners["draft"]), ["propose", "prefill", "release"], key, host="127.0.0.1", name="draft0"),
    }
    tap = Tap(servers["target"].endpoint, key, replay_verifies=3)
    clients = {
        "target": CommandClient("target", tap.endpoint, key, timeout_s=60),
        "draft0": CommandClient("draft0", servers["draft0"].endpoint, key, timeout_s=60),
    }
    max_context = min(r.max_context for r in runners.values())
    loop = RoundLoop(SpeculationConfig(mode="sd", k=3), clients["target"], runners["target"].eos_token_ids, max_context, draft=[clients["draft0"]])
    kv = runners["target"].kv
    scheduler = Scheduler(loop, 8, kv_tokens=kv.num_blocks * kv.block_size, block_size=kv.block_size)
    try:
        got = Frontend(tokenizer, runners["target"].vocab_size, max_context, loop.menu, scheduler).generate(prompts, params)
        assert [r.token_ids for r in got] == expected
        assert tap.replayed >= 3 * 10
        _wait_for(lambda: servers["target"].drop_reasons.get("replayed", 0) == tap.replayed, f"{servers['target'].drop_reasons} of {tap.replayed}")
        assert servers["target"].dropped_frames == tap.replayed
    finally:
        scheduler.shutdown()
        for c in clients.values():
            c.close()
        tap.close()
        for s in servers.values():
            s.close()


def test_ipc_dirs_of_processes_that_are_gone_are_removed(monkeypatch):
    """A worker killed before it could close leaves its IPC dir; the next
    process to bind one on the node removes it (and no one else's)."""
    import subprocess
    import sys
    import tempfile

    from saguaro_ray.runtime.control import endpoints as control

    # a short root of its own: pytest's tmp_path (longer under xdist) can push the socket path
    # past the 107 characters a Unix socket's address holds
    root = tempfile.TemporaryDirectory(prefix="sgr-")
    tmp_path = Path(root.name)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"saguaro-zmq-{gone.pid}-abc"
    alive = tmp_path / f"saguaro-zmq-{os.getppid()}-abc"
    unnamed = tmp_path / "saguaro-zmq-abc"  # an older layout: not ours to judge
    for d in (dead, alive, unnamed):
        d.mkdir()
    monkeypatch.setattr(control, "_ipc_dir_root", lambda: str(tmp_path))
    monkeypatch.setattr(control, "_swept", False)
    s = zmq.Context.instance().socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    ipc = ""
    try:
        ipc = bind_endpoint(s, None, name="probe")
        assert os.path.basename(os.path.dirname(ipc[6:])).startswith(f"saguaro-zmq-{os.getpid()}-")
        assert not dead.exists() and alive.exists() and unnamed.exists()
    finally:
        s.close(0)
        release_endpoint(ipc)
        root.cleanup()


# ---------------------------------------------------------------- encryption


class Wiretap:
    """A TCP relay to ``upstream`` (``tcp://host:port``) that keeps every byte it passes."""

    def __init__(self, upstream: str) -> None:
        import socket

        host, port = upstream[len("tcp://") :].rsplit(":", 1)
        self._upstream = (host, int(port))
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except socket.timeout:
                continue
            up = socket.create_connection(self._upstream)
            for a, b in ((down, up), (up, down)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst) -> None:
        src.settimeout(0.1)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        self._listener.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_curve_hides_tcp_frames_from_the_network(encrypt):
    """With an encrypting engine key, nothing a call or a broadcast carries
    over TCP can be read off the wire; a peer that does not know the
    server's CURVE key gets no answer at all."""
    from saguaro_ray.runtime.control import EngineKey

    key = EngineKey.generate(encrypt)
    server = CommandServer(Recorder(), ALLOWED, key, host="127.0.0.1", name="w")
    bus = Broadcaster(key, host="127.0.0.1")
    calls, casts = Wiretap(server.endpoint), Wiretap(bus.endpoint)
    marker, shout = f"secret-{uuid.uuid4().hex}", f"outcome-{uuid.uuid4().hex}"
    client = CommandClient("w", calls.endpoint, key, timeout_s=20)
    try:
        assert client.call("echo", marker) == (marker,)
        sub = Subscriber([casts.endpoint, *bus.invitation()[1:]], key)
        try:
            bus.wait_for([sub.id], timeout_s=20)
            bus.publish(shout)
            assert sub.recv(10) == shout
        finally:
            sub.close()
        with calls._lock, casts._lock:
            assert (marker.encode() in calls.seen) is not encrypt
            assert (shout.encode() in casts.seen) is not encrypt
        if encrypt:
            with CommandClient("w", server.endpoint, bytes(key), timeout_s=1) as plain:  # the HMAC key, no CURVE
                with pytest.raises(WorkerTimeout):
                    plain.ping(1.0)
    finally:
        client.close()
        calls.close()
        casts.close()
        bus.close()
        server.close()

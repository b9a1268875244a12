"""The transport over real ZeroMQ (ipc and loopback tcp) and in memory.

A trio ROUTER (AsyncSocket, the coordinator's side) talks to BlockingClient
(a rank's side, driven from a worker thread as a rank's main thread would).
"""

import os
import random
import re
import threading
import time

import pytest
import trio
import trio.testing
import zmq

from prism.core.protocol import (
    PROTOCOL_VERSION,
    CollectiveArrive,
    CollectiveResult,
    Error,
    Goodbye,
    Hello,
    ProtocolError,
    Shutdown,
    SlotGrant,
    SlotRequest,
    VersionMismatch,
    Welcome,
    check_hello,
    encode,
)
from transport import (
    AsyncSocket,
    BlockingClient,
    CoordinatorError,
    CoordinatorLost,
    HandshakeRefused,
    MemoryRouter,
    UnsafeEndpointError,
    check_listen_endpoint,
    default_endpoint,
    memory_pair,
)

TIMEOUT = 10.0  # seconds; only reached when something is broken


def hello(rank=0, version=PROTOCOL_VERSION):
    return Hello(version, rank, 4, rank, os.getpid(), "testhost", "cpu", time.monotonic_ns())


def arrive(seq, payload=b"abcd", gid="g"):
    return CollectiveArrive(
        0, gid, seq, "allreduce", "sum", "uint8", ((len(payload),),), ((len(payload),),),
        payloads=(payload,),
    )


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request, tmp_path):
    if request.param == "ipc":
        return default_endpoint(tmp_path)
    return "tcp://127.0.0.1:*"


class Coordinator:
    """A minimal coordinator loop: handshake, echo collectives, and the
    hooks tests need. Malformed messages are answered with an Error."""

    def __init__(self, sock: AsyncSocket):
        self.sock = sock
        self.bad: list[ProtocolError] = []
        self.held: list[tuple[bytes, CollectiveArrive]] = []
        #: Hold this many collectives and answer them in shuffled order.
        self.hold = 0

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        while True:
            try:
                ident, msg = await self.sock.recv_message()
            except ProtocolError as e:
                self.bad.append(e)
                await self.sock.send_message(Error("bad_message", str(e)), e.identity)
                continue
            await self.handle(ident, msg)

    async def handle(self, ident, msg):
        if isinstance(msg, Hello):
            try:
                check_hello(msg)
            except VersionMismatch as e:
                await self.sock.send_message(Error("version", str(e), rank=msg.rank), ident)
                return
            await self.sock.send_message(Welcome(PROTOCOL_VERSION, "run-1", 0, 1024), ident)
        elif isinstance(msg, CollectiveArrive):
            if msg.gid == "fail":
                await self.sock.send_message(
                    Error("mismatch", f"rank 0 called {msg.op} on group fail", gid="fail"), ident
                )
            elif msg.gid == "stop":
                await self.sock.send_message(Shutdown("the user pressed Ctrl-C"), ident)
            elif msg.gid == "slow":
                await trio.sleep(0.05)
                await self.sock.send_message(CollectiveResult(msg.gid, msg.seq), ident)
            elif self.hold:
                self.held.append((ident, msg))
                if len(self.held) == self.hold:
                    random.Random(0).shuffle(self.held)
                    for i, m in self.held:
                        await self.sock.send_message(CollectiveResult(m.gid, m.seq, m.payloads), i)
                    self.held.clear()
            else:
                await self.sock.send_message(CollectiveResult(msg.gid, msg.seq, msg.payloads), ident)
        elif isinstance(msg, SlotRequest):
            await self.sock.send_message(SlotGrant(msg.rank), ident)


@pytest.fixture
async def coordinator(endpoint):
    sock = AsyncSocket.create(zmq.ROUTER)
    address = sock.bind(endpoint)
    coord = Coordinator(sock)
    coord.endpoint = address
    async with trio.open_nursery() as nursery:
        await nursery.start(coord.serve)
        yield coord
        nursery.cancel_scope.cancel()
    sock.close()


def in_rank(fn):
    """Run ``fn`` as a rank's main thread would (blocking, no trio)."""
    return trio.to_thread.run_sync(fn)


# --- handshake -----------------------------------------------------------


async def test_handshake_welcomes_a_rank(coordinator):
    def rank():
        client, welcome = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        client.send(Goodbye(0, "ok")).result(TIMEOUT)
        client.close()
        return welcome

    welcome = await in_rank(rank)
    assert welcome == Welcome(PROTOCOL_VERSION, "run-1", 0, 1024)


async def test_handshake_refused_on_version_mismatch(coordinator):
    def rank():
        with pytest.raises(HandshakeRefused) as info:
            BlockingClient.connect(coordinator.endpoint, hello(version=99), timeout=TIMEOUT)
        return info.value

    err = await in_rank(rank)
    assert isinstance(err, ConnectionError)
    assert err.msg.code == "version"
    assert str(err) == (
        f"rank 0 (pid {os.getpid()} on testhost) speaks Prism protocol 99, this coordinator "
        f"speaks {PROTOCOL_VERSION}: install the same Prism version for the coordinator and "
        f"the ranks [error 'version' from the coordinator at {coordinator.endpoint}]"
    )


async def test_handshake_times_out_naming_the_endpoint(tmp_path):
    endpoint = default_endpoint(tmp_path)  # nobody listens there

    def rank():
        with pytest.raises(CoordinatorLost) as info:
            BlockingClient.connect(endpoint, hello(), timeout=0.2)
        return info.value

    err = await in_rank(rank)
    assert str(err).startswith(
        f"rank 0: no Welcome from the coordinator at {endpoint} within 0.2 s; "
        "is `python -m prism coordinator` running"
    )


# --- requests and replies --------------------------------------------------


async def test_request_reply_and_a_reply_before_its_future(coordinator):
    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        with client:
            fut = client.future(("coll", "g", 1))
            client.send(arrive(1, b"hello"))
            assert bytes(memoryview(fut.result(TIMEOUT).payloads[0])) == b"hello"
            # The grant arrives before anyone waits for it; it must be kept.
            client.send(SlotRequest(0))
            deadline = time.monotonic() + TIMEOUT
            while ("slot",) not in client._early and time.monotonic() < deadline:
                time.sleep(0.001)
            assert client.future(("slot",)).result(TIMEOUT) == SlotGrant(0)

    await in_rank(rank)


async def test_many_futures_resolved_out_of_order(coordinator):
    n = 64
    coordinator.hold = n

    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        with client:
            futures = [client.future(("coll", "g", seq)) for seq in range(n)]
            for seq in range(n):
                client.send(arrive(seq, seq.to_bytes(4, "little")))
            order = []
            for f in futures:
                f.add_done_callback(lambda f: order.append(f.result().seq))
            for seq, f in enumerate(futures):
                r = f.result(TIMEOUT)
                assert (r.seq, bytes(memoryview(r.payloads[0]))) == (seq, seq.to_bytes(4, "little"))
            return order

    order = await in_rank(rank)
    assert sorted(order) == list(range(n))
    assert order != list(range(n))  # the coordinator really answered out of order


async def test_threads_share_one_client(coordinator):
    """Threads take turns receiving for each other (leader/followers) while
    the I/O thread fills in: every reply reaches its own waiter."""
    threads, n = 4, 100

    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        errors = []

        def worker(t):
            try:
                for i in range(n):
                    seq = t * n + i
                    fut = client.future(("coll", "g", seq))
                    client.send(arrive(seq, seq.to_bytes(4, "little")))
                    reply = fut.result(TIMEOUT)
                    assert bytes(memoryview(reply.payloads[0])) == seq.to_bytes(4, "little")
            except BaseException as e:  # reported to the test below
                errors.append(e)

        with client:
            workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(TIMEOUT * 2)
        return errors, [w.is_alive() for w in workers]

    errors, alive = await in_rank(rank)
    assert errors == []
    assert not any(alive)


async def test_async_completion_while_the_main_thread_computes(coordinator):
    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        with client:
            fut = client.future(("coll", "slow", 0))
            client.send(arrive(0, gid="slow"))
            sent_done = fut.done()
            # Busy Python loop: never waits on the future, yet it completes.
            deadline = time.monotonic() + TIMEOUT
            while not fut.done() and time.monotonic() < deadline:
                pass
            return sent_done, fut.done()

    assert await in_rank(rank) == (False, True)


async def test_error_fails_pending_and_later_futures_and_calls_on_error(coordinator):
    seen = []

    def rank():
        client, _ = BlockingClient.connect(
            coordinator.endpoint, hello(), timeout=TIMEOUT, on_error=seen.append
        )
        with client:
            pending = client.future(("coll", "g", 5))
            client.send(arrive(0, gid="fail"))
            with pytest.raises(CoordinatorError, match=r"rank 0 called allreduce on group fail \[error 'mismatch'"):
                pending.result(TIMEOUT)
            with pytest.raises(CoordinatorError, match="mismatch"):
                client.future(("coll", "g", 6)).result(TIMEOUT)
            assert client.failure is not None

    await in_rank(rank)
    assert [m.code for m in seen] == ["mismatch"]


async def test_shutdown_fails_futures(coordinator):
    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        with client:
            fut = client.future(("coll", "g", 0))
            client.send(arrive(0, gid="stop"))
            with pytest.raises(CoordinatorError, match="shut the run down: the user pressed Ctrl-C"):
                fut.result(TIMEOUT)

    await in_rank(rank)


async def test_lost_coordinator_fails_futures_naming_the_endpoint(endpoint):
    sock = AsyncSocket.create(zmq.ROUTER)
    address = sock.bind(endpoint)
    coord = Coordinator(sock)
    async with trio.open_nursery() as nursery:
        await nursery.start(coord.serve)
        client, _ = await in_rank(lambda: BlockingClient.connect(address, hello(), timeout=TIMEOUT))
        fut = client.future(("coll", "g", 0))
        nursery.cancel_scope.cancel()
    sock.close()  # the coordinator dies with the collective pending

    def rank():
        with client:
            with pytest.raises(CoordinatorLost, match=f"lost the connection to the coordinator at {address}"):
                fut.result(TIMEOUT)

    await in_rank(rank)


async def test_close_cancels_pending_futures(coordinator):
    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        fut = client.future(("coll", "g", 0))
        client.close()
        assert fut.cancelled()
        with pytest.raises(RuntimeError, match="closed BlockingClient"):
            client.send(Goodbye(0, "ok"))

    await in_rank(rank)


async def test_large_payload_arrives_intact(coordinator):
    payload = bytearray(random.Random(1).randbytes(64 << 20))

    def rank():
        client, _ = BlockingClient.connect(coordinator.endpoint, hello(), timeout=TIMEOUT)
        with client:
            fut = client.future(("coll", "g", 0))
            sent = client.send(arrive(0, payload))
            reply = fut.result(TIMEOUT)
            sent.result(TIMEOUT)  # ZeroMQ is done with the buffer
            return memoryview(reply.payloads[0]) == memoryview(payload)

    assert await in_rank(rank)


# --- the trio socket ------------------------------------------------------


async def test_malformed_message_gets_an_error_and_the_server_lives_on(coordinator):
    dealer = AsyncSocket.create(zmq.DEALER)
    dealer.connect(coordinator.endpoint)
    with dealer:
        await dealer.send_multipart([b"\x16\x03\x01\x02\x00"])  # a TLS Client Hello
        _, reply = await dealer.recv_message()
        assert reply.code == "bad_message"
        assert "header frame is not valid JSON" in reply.message
        await dealer.send_message(hello())
        _, reply = await dealer.recv_message()
        assert isinstance(reply, Welcome)
    assert len(coordinator.bad) == 1
    assert coordinator.bad[0].identity is not None


async def test_send_and_receive_tasks_share_one_socket(coordinator):
    """A sending and a receiving task wait on one edge-triggered descriptor;
    a tiny send queue makes the sender wait for room too."""
    n = 300
    dealer = AsyncSocket.create(zmq.DEALER)
    dealer.socket.setsockopt(zmq.SNDHWM, 2)
    dealer.connect(coordinator.endpoint)
    got = []

    async def sender():
        for seq in range(n):
            await dealer.send_message(arrive(seq))

    async def receiver():
        while len(got) < n:
            _, msg = await dealer.recv_message()
            got.append(msg.seq)

    with dealer, trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            nursery.start_soon(sender)
    assert got == list(range(n))


async def test_two_receivers_raise_busy_resource_error():
    sock = AsyncSocket.create(zmq.DEALER)
    with sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sock.recv_message)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError, match="another task is already receiving"):
                await sock.recv_message()
            nursery.cancel_scope.cancel()


async def test_cancelled_receive_leaves_the_socket_usable(coordinator):
    dealer = AsyncSocket.create(zmq.DEALER)
    dealer.connect(coordinator.endpoint)
    with dealer:
        with trio.move_on_after(0.05):
            await dealer.recv_message()
        await dealer.send_message(hello())
        _, reply = await dealer.recv_message()
        assert isinstance(reply, Welcome)


async def test_close_wakes_a_waiting_receiver():
    sock = AsyncSocket.create(zmq.DEALER)
    async with trio.open_nursery() as nursery:

        async def receive():
            with pytest.raises(trio.ClosedResourceError):
                await sock.recv_message()

        nursery.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        sock.close()
    with pytest.raises(trio.ClosedResourceError):
        await sock.send_message(hello())


async def test_router_send_needs_an_identity():
    with AsyncSocket.create(zmq.ROUTER) as sock:
        with pytest.raises(ValueError, match="needs the peer's identity"):
            await sock.send_message(SlotGrant(0))


# --- endpoints -----------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://192.168.0.1:1",
     "tcp://[::]:5555", "tcp://eth0:5555", "tcp://example.com:80", "pgm://eth0;239.1.1.1:5555"],
)
def test_listening_beyond_loopback_is_refused(endpoint):
    with pytest.raises(
        UnsafeEndpointError,
        match=rf"refusing to listen on {re.escape(endpoint)}: "
        r"Prism listens only on ipc:// or loopback .*CURVE authentication is on .*"
        r"`prism keys DIR`.*use ipc:// or tcp://127.0.0.1:PORT",
    ):
        check_listen_endpoint(endpoint)
    check_listen_endpoint(endpoint, authenticated=True)


@pytest.mark.parametrize(
    "endpoint",
    ["ipc:///tmp/x/prism.sock", "inproc://a", "tcp://127.0.0.1:5555", "tcp://127.4.5.6:*",
     "tcp://localhost:5555", "tcp://[::1]:5555"],
)
def test_loopback_and_ipc_are_accepted(endpoint):
    check_listen_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "tcp://127.0.0.1", "tcp://:5555"])
def test_malformed_endpoints_are_named(endpoint):
    with pytest.raises(UnsafeEndpointError, match="expected"):
        check_listen_endpoint(endpoint)


def test_bind_applies_the_policy():
    with AsyncSocket.create(zmq.ROUTER) as sock:
        with pytest.raises(UnsafeEndpointError, match="refusing to listen on tcp://0.0.0.0:0"):
            sock.bind("tcp://0.0.0.0:0")


def test_default_endpoint_falls_back_to_a_short_temporary_path(tmp_path):
    assert default_endpoint(tmp_path) == f"ipc://{tmp_path}/prism.sock"
    deep = tmp_path / ("d" * 120)
    endpoint = default_endpoint(deep)
    assert endpoint.startswith("ipc://") and endpoint.endswith("/prism.sock")
    assert str(deep) not in endpoint
    assert len(endpoint) - len("ipc://") <= 103
    os.rmdir(os.path.dirname(endpoint[len("ipc://"):]))


# --- the in-memory pair --------------------------------------------------


async def test_memory_pair_carries_messages_through_the_codec():
    router, dealer = memory_pair(identity=b"rank0")
    payload = bytearray(b"data")
    await dealer.send_message(arrive(0, payload))
    payload[:] = b"XXXX"  # the codec copied it, as a real socket would send it
    ident, msg = await router.recv_message()
    assert ident == b"rank0"
    assert bytes(msg.payloads[0]) == b"data"
    await router.send_message(CollectiveResult("g", 0), b"rank0")
    assert await dealer.recv_message() == (None, CollectiveResult("g", 0))
    with pytest.raises(ValueError, match="no peer with identity b'rank9'"):
        await router.send_message(SlotGrant(0), b"rank9")


async def test_nowait_sends_do_not_yield(coordinator):
    dealer = AsyncSocket.create(zmq.DEALER)
    dealer.connect(coordinator.endpoint)
    router, peer = memory_pair(identity=b"r")
    with dealer:
        dealer.send_message_nowait(hello())
        router.send_message_nowait(SlotGrant(1), b"r")
        assert (await dealer.recv_message())[1] == Welcome(PROTOCOL_VERSION, "run-1", 0, 1024)
        assert await peer.recv_message() == (None, SlotGrant(1))
        dealer.socket.setsockopt(zmq.SNDHWM, 1)
        dealer.socket.disconnect(coordinator.endpoint)  # nobody to take the queue
        with pytest.raises(trio.WouldBlock):
            for seq in range(100):
                dealer.send_message_nowait(arrive(seq))


async def test_memory_pair_without_codec_passes_objects():
    a, b = memory_pair(codec=False)
    msg = arrive(0)
    await a.send_message(msg)
    assert (await b.recv_message())[1] is msg


async def test_memory_pair_reports_malformed_frames():
    router, dealer = memory_pair(identity=b"r")
    await dealer.send_multipart([b"{}"])
    with pytest.raises(ProtocolError, match="unknown message type None") as info:
        await router.recv_message()
    assert info.value.identity == b"r"
    await dealer.send_multipart(encode(SlotRequest(0)))
    assert await router.recv_message() == (b"r", SlotRequest(0))


async def test_memory_pair_delay_keeps_order(autojump_clock):
    delays = {0: 5.0, 1: 1.0, 2: 0.0}
    a, b = memory_pair(delay=lambda m: delays[m.seq])
    start = trio.current_time()
    for seq in range(3):
        await a.send_message(CollectiveResult("g", seq))
    arrivals = []
    for _ in range(3):
        _, msg = await b.recv_message()
        arrivals.append((msg.seq, trio.current_time() - start))
    # Later messages wait behind the slow first one, as on one connection.
    assert arrivals == [(0, 5.0), (1, 5.0), (2, 5.0)]
    await a.send_message(CollectiveResult("g", 1))
    t = trio.current_time()
    await b.recv_message()
    assert trio.current_time() - t == 1.0


async def test_memory_pair_drop_loses_messages(autojump_clock):
    a, b = memory_pair(drop=lambda m: m.seq % 2 == 1)
    for seq in range(4):
        await a.send_message(CollectiveResult("g", seq))
    assert [(await b.recv_message())[1].seq for _ in range(2)] == [0, 2]
    with trio.move_on_after(100) as scope:
        await b.recv_message()
    assert scope.cancelled_caught


async def test_memory_pair_busy_and_closed():
    a, b = memory_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.recv_message)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await b.recv_message()
        nursery.cancel_scope.cancel()
    a.close()
    with pytest.raises(trio.BrokenResourceError, match="other end of the memory pair was closed"):
        await b.recv_message()
    with pytest.raises(trio.ClosedResourceError):
        await a.send_message(SlotGrant(0))


# --- the in-memory router --------------------------------------------------


async def test_memory_router_serves_many_dealers_by_identity():
    router = MemoryRouter()
    a, b = router.connect(b"a"), router.connect(b"b")
    payload = bytearray(b"data")
    await b.send_message(arrive(0, payload))
    payload[:] = b"XXXX"  # the codec copied it
    await a.send_message(SlotRequest(0))
    got = [await router.recv_message() for _ in range(2)]
    assert [i for i, _ in got] == [b"b", b"a"]  # oldest first, across connections
    assert bytes(got[0][1].payloads[0]) == b"data" and got[1][1] == SlotRequest(0)
    await router.send_message(SlotGrant(1), b"b")
    assert await b.recv_message() == (None, SlotGrant(1))
    with pytest.raises(ValueError, match="no peer with identity b'c'"):
        await router.send_message(SlotGrant(0), b"c")
    with pytest.raises(ValueError, match="already connected"):
        router.connect(b"a")
    await a.send_multipart([b"{}"])
    with pytest.raises(ProtocolError, match="unknown message type None") as info:
        await router.recv_message()
    assert info.value.identity == b"a"


async def test_memory_router_delays_one_connection_only(autojump_clock):
    router = MemoryRouter()
    slow = router.connect(b"slow", delay=lambda m: 5.0 if m.seq == 0 else 0.0)
    fast = router.connect(b"fast")
    start = trio.current_time()
    await slow.send_message(CollectiveResult("g", 0))
    await slow.send_message(CollectiveResult("g", 1))
    await fast.send_message(CollectiveResult("g", 2))
    arrivals = []
    for _ in range(3):
        ident, msg = await router.recv_message()
        arrivals.append((ident, msg.seq, trio.current_time() - start))
    # The fast peer is not held behind the slow one; the slow one keeps its order.
    assert arrivals == [(b"fast", 2, 0.0), (b"slow", 0, 5.0), (b"slow", 1, 5.0)]
    # A message sent while the router waits for a later one wakes it.
    async with trio.open_nursery() as n:
        await slow.send_message(CollectiveResult("g", 0))
        n.start_soon(fast.send_message, CollectiveResult("g", 3))
        ident, msg = await router.recv_message()
        assert (ident, msg.seq) == (b"fast", 3)


async def test_memory_router_drops_and_vanished_peers(autojump_clock):
    router = MemoryRouter(drop=lambda m: getattr(m, "seq", 0) == 1)
    a = router.connect(b"a")
    for seq in range(3):
        await a.send_message(CollectiveResult("g", seq))
    assert [(await router.recv_message())[1].seq for _ in range(2)] == [0, 2]
    await a.send_message(SlotRequest(0))
    a.close()  # what it sent before still arrives; what goes to it is lost
    assert await router.recv_message() == (b"a", SlotRequest(0))
    await router.send_message(SlotGrant(0), b"a")
    assert router.identities == []
    with trio.move_on_after(100) as scope:
        await router.recv_message()
    assert scope.cancelled_caught
    b = router.connect(b"b")
    router.close()
    with pytest.raises(trio.BrokenResourceError):
        await b.recv_message()
    with pytest.raises(trio.ClosedResourceError):
        await router.recv_message()


def test_a_curve_server_started_again_at_once_gets_the_zap_address_back(tmp_path):
    # ZeroMQ frees the ZAP handler's inproc address a little after its socket
    # closes: a CURVE server started again at once in the same process (a
    # daemon's next run) used to fail with "Address already in use".
    import zmq

    from transport.curve import make_keys, serve_curve

    make_keys(tmp_path / "keys")
    ctx = zmq.Context()
    try:
        for _ in range(20):
            sock = ctx.socket(zmq.ROUTER)
            auth = serve_curve(sock, tmp_path / "keys", ctx)
            sock.bind("tcp://127.0.0.1:*")
            sock.close(linger=0)
            auth.stop()
    finally:
        ctx.destroy(linger=0)

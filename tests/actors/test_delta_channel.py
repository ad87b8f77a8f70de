"""The delta channel (actors/delta_channel.py) on loopback, without Ray: submits and aborts reach the
router in order with the connection's queue, what the router's writer sends arrives in order, a
submit that waits for its grammar is cancelled by an abort that comes first, a stranger is refused,
each connection has a queue of its own, and the end of a connection reaches the router (its
requests aborted) and the ingress (its router lost)."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time

import pytest

from raymoe.actors.delta_channel import SECRET_BYTES, ChannelAddress, DeltaChannel, DeltaChannelServer
from raymoe.actors.router import StepFailure, TokenDelta


class FakeRouter:
    """The router's side of the contract: a fresh queue per subscriber's connection, detach when it ends."""

    def __init__(self):
        self.queues: dict[str, queue.Queue] = {}
        self.attached: list[tuple[str, queue.Queue]] = []
        self.detached: list[tuple[str, queue.Queue]] = []
        self.stop = False
        self.submitted: list[tuple] = []  # (request id, prompt, params, resumed, the connection's queue)
        self.aborted: list[str] = []
        self.gate = threading.Event()  # a slow submit (params == "grammar") waits for it
        self.gate.set()
        self.server = DeltaChannelServer("127.0.0.1", self.attach, self.detach, lambda: self.stop, self.submit,
                                         self.aborted.append, slow=lambda params: params == "grammar",
                                         prepare=lambda params: self.gate.wait(10))

    def submit(self, request_id, prompt_ids, params, resume_ids, target) -> None:
        self.submitted.append((request_id, prompt_ids, params, resume_ids, target))

    def attach(self, subscriber: str) -> queue.Queue:
        target = self.queues[subscriber] = queue.Queue()
        self.attached.append((subscriber, target))
        return target

    def detach(self, subscriber: str, target: queue.Queue) -> None:
        self.detached.append((subscriber, target))


@pytest.fixture
def router():
    fake = FakeRouter()
    yield fake
    fake.stop = True
    fake.server.close()
    wait_for(lambda: fake.server.connections == 0)  # its writer threads gone (within their 1 s idle wait)


def delta(request_id: str, token: int, finished: bool = False) -> TokenDelta:
    return TokenDelta(request_id, [token], [-0.5], [], finished, "length" if finished else None, None, 3)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_batches_arrive_in_order_with_their_fields(router):
    async def main():
        channel = await DeltaChannel.connect(router.server.address, "ingress-a")
        target = router.queues["ingress-a"]  # registered before connect() returned
        target.put([delta("r1", 5), delta("r2", 6)])
        first = await asyncio.wait_for(channel.read(), 5)
        # two more steps: in one frame or two (whatever the writer found queued), in step order
        target.put([delta("r1", 7)])
        target.put([delta("r1", 8, finished=True), StepFailure("r2", "boom", status=500)])
        seen = []
        while len(seen) < 3:
            seen += await asyncio.wait_for(channel.read(), 5)
        channel.close()
        return first, seen

    first, seen = asyncio.run(main())
    assert [(d.request_id, d.token_ids, d.logprobs) for d in first] == [("r1", [5], [-0.5]), ("r2", [6], [-0.5])]
    assert [getattr(d, "token_ids", None) for d in seen] == [[7], [8], None]
    assert seen[1].finished and seen[1].finish_reason == "length"
    assert isinstance(seen[2], StepFailure) and seen[2].status == 500 and seen[2].message == "boom"


def test_a_wrong_secret_is_closed_unanswered_and_registers_nothing(router):
    address = router.server.address
    wrong = ChannelAddress(address.host, address.port, bytes(SECRET_BYTES))

    async def main():
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await DeltaChannel.connect(wrong, "intruder")

    asyncio.run(main())
    assert router.attached == [] and "intruder" not in router.queues
    # a connection that never says hello is closed too (here: it sends half a secret and stops)
    with socket.create_connection((address.host, address.port)) as raw:
        raw.sendall(address.secret[:4])
        raw.shutdown(socket.SHUT_WR)
        assert raw.recv(16) == b""
    assert router.attached == []


def test_each_connection_has_a_queue_of_its_own_and_its_end_is_detached(router):
    async def connect():
        return await DeltaChannel.connect(router.server.address, "ingress-b")

    async def connect_and_leave():
        channel = await connect()
        channel.close()
        await asyncio.sleep(0.1)

    asyncio.run(connect_and_leave())
    old = router.queues["ingress-b"]
    deadline = time.monotonic() + 5
    while ("ingress-b", old) not in router.detached:  # the writer notices on a write: give it some
        assert time.monotonic() < deadline, "the end of the connection never reached the router"
        old.put([delta("gone", 1)])
        time.sleep(0.05)

    async def second_connection():
        channel = await connect()
        new = router.queues["ingress-b"]
        assert new is not old
        old.put([delta("stale", 2)])  # what an old writer's queue gets never reaches the new connection
        new.put([delta("fresh", 3)])
        items = await asyncio.wait_for(channel.read(), 5)
        channel.close()
        return items

    assert [d.request_id for d in asyncio.run(second_connection())] == ["fresh"]


def test_a_stopping_router_ends_the_stream_and_the_ingress_reads_its_end(router):
    async def main():
        channel = await DeltaChannel.connect(router.server.address, "ingress-c")
        router.stop = True  # the writer ends within its idle wait (1 s)
        started = time.monotonic()
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(channel.read(), 5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 3
    wait_for(lambda: [s for s, _ in router.detached] == ["ingress-c"])


def test_many_steps_from_a_writer_thread_arrive_whole(router):
    """The writer is the router's own thread: 2,000 steps of 32 deltas each, none lost or reordered."""
    async def main():
        channel = await DeltaChannel.connect(router.server.address, "ingress-d")
        target = router.queues["ingress-d"]

        def step_thread():
            for step in range(2000):
                target.put([delta(f"r{i}", step) for i in range(32)])

        threading.Thread(target=step_thread, daemon=True).start()
        tokens: dict[str, list[int]] = {}
        while sum(map(len, tokens.values())) < 2000 * 32:
            for item in await asyncio.wait_for(channel.read(), 10):
                tokens.setdefault(item.request_id, []).append(item.token_ids[0])
        channel.close()
        return tokens

    tokens = asyncio.run(main())
    assert sorted(tokens) == sorted(f"r{i}" for i in range(32))
    assert all(seen == list(range(2000)) for seen in tokens.values())


async def wait_async(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_submits_and_aborts_reach_the_router_in_order_with_the_connections_queue(router):
    async def main():
        channel = await DeltaChannel.connect(router.server.address, "ingress-e")
        channel.submit("r1", [1, 2, 3], "greedy", None)
        channel.submit("r2", [4], "greedy", [9, 9])
        channel.abort("r1")
        await wait_async(lambda: router.aborted == ["r1"])
        channel.close()

    asyncio.run(main())
    target = router.queues["ingress-e"]
    assert [(r, p, s, t) for r, p, s, t, _ in router.submitted] == [("r1", [1, 2, 3], "greedy", None),
                                                                     ("r2", [4], "greedy", [9, 9])]
    assert all(q is target for *_, q in router.submitted)


def test_a_submit_waiting_for_its_grammar_holds_up_no_other_and_an_abort_first_cancels_it(router):
    router.gate.clear()

    async def main():
        channel = await DeltaChannel.connect(router.server.address, "ingress-f")
        channel.submit("slow", [1], "grammar", None)
        channel.submit("fast", [2], "greedy", None)
        channel.submit("slow-aborted", [3], "grammar", None)
        channel.abort("slow-aborted")
        await wait_async(lambda: [r for r, *_ in router.submitted] == ["fast"] and router.aborted == ["slow-aborted"])
        router.gate.set()
        await wait_async(lambda: len(router.submitted) == 2)
        await asyncio.sleep(0.2)  # the aborted one would have been submitted by now
        channel.close()

    asyncio.run(main())
    assert [r for r, *_ in router.submitted] == ["fast", "slow"]


def test_a_channel_the_ingress_cannot_open_fails_its_requests_saying_what_to_do(caplog):
    """A router whose channel port is unreachable (here: nothing listens there): the request fails
    over like on a lost router, and the failure and the log name the address and the remedy."""
    from raymoe.actors.router_relay import RouterRelay
    from raymoe.actors.serving_metrics import ServingMetrics
    from raymoe.engine.sampling_params import SamplingParams

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    class Remote:
        def __init__(self, value=None):
            self.value = value

        def remote(self, *args):
            future = asyncio.get_running_loop().create_future()
            future.set_result(self.value)
            return future

    class UnreachableRouter:
        delta_channel = Remote(ChannelAddress("127.0.0.1", port, bytes(SECRET_BYTES)))
        abort = Remote()

    async def main():
        relay = RouterRelay([UnreachableRouter()], ServingMetrics(4, "m"), max_migrations=0)
        return [item async for item in relay.deltas([1, 2], SamplingParams(max_tokens=2), "req-1", time.perf_counter())]

    with caplog.at_level("WARNING", logger="raymoe.ingress"):
        items = asyncio.run(main())
    assert len(items) == 1 and isinstance(items[0], StepFailure)
    assert f"127.0.0.1:{port}" in items[0].message and "serve.delta_channel: false" in items[0].message
    assert any("could not be opened" in record.getMessage() for record in caplog.records)

"""CPU per router step of the three ways a step's token deltas can reach an ingress replica.

Two Ray actors on a local Ray: a producer (the router's side) makes one batch of ``--per-step``
TokenDeltas every ``--period-ms`` for ``--steps`` steps; an asyncio consumer (the ingress' side)
reads them:

1. a Ray streaming generator (``Router.subscribe``, ``serve.delta_channel: false``): one item a step;
2. a long-polling actor call a step (a blocking ``next()`` on a queue): what a pull design would pay;
3. the delta channel (actors/delta_channel.py, the default): one frame a step on a socket.

Prints each process's CPU microseconds per step (from /proc, its whole process, less what the same
processes take idle over the same time) and the channel's ratio to the other two. A Ray call costs
about the same as a streamed item, so (1) is also about what each request's ``submit`` call costs.

    python benchmarks/bench_delta_channel.py [--steps 1000] [--per-step 32] [--period-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only

import ray  # noqa: E402

from raymoe.actors.delta_channel import DeltaChannel, DeltaChannelServer  # noqa: E402
from raymoe.actors.router import TokenDelta  # noqa: E402
from raymoe.cluster import procfs  # noqa: E402


def batch(step: int, per_step: int) -> list[TokenDelta]:
    return [TokenDelta(f"cmpl-{i}", [step % 500], [-0.25], [], False, None, None, 32) for i in range(per_step)]


@ray.remote(max_concurrency=8)
class Producer:
    def __init__(self, per_step: int, period_s: float):
        self.per_step, self.period_s = per_step, period_s
        self.polled: queue.Queue = queue.Queue()
        self.channel_queue: queue.Queue = queue.Queue()
        self.server = DeltaChannelServer("127.0.0.1", self._attach, lambda *_: None, lambda: False,
                                         lambda *_: None, lambda _: None)

    def pid(self) -> int:
        return os.getpid()

    def _attach(self, _subscriber: str) -> queue.Queue:
        return self.channel_queue

    def _steps(self, steps: int, put) -> None:
        for step in range(steps):
            time.sleep(self.period_s)
            put(batch(step, self.per_step))

    # 1. Ray's stream
    def subscribe(self, steps: int):
        for step in range(steps):
            time.sleep(self.period_s)
            yield batch(step, self.per_step)

    # 2. long polling
    def start_polled(self, steps: int) -> None:
        threading.Thread(target=self._steps, args=(steps, self.polled.put), daemon=True).start()

    def next(self) -> list:
        return self.polled.get()

    # 3. the delta channel
    def channel_address(self):
        return self.server.address

    def start_channel(self, steps: int) -> None:
        threading.Thread(target=self._steps, args=(steps, self.channel_queue.put), daemon=True).start()


@ray.remote
class Consumer:
    def pid(self) -> int:
        return os.getpid()

    async def stream(self, producer, steps: int, _per_step: int) -> int:
        n = 0
        async for ref in producer.subscribe.options(num_returns="streaming").remote(steps):
            n += len(await ref)
        return n

    async def poll(self, producer, steps: int, _per_step: int) -> int:
        await producer.start_polled.remote(steps)
        n = 0
        for _ in range(steps):
            n += len(await producer.next.remote())
        return n

    async def channel(self, producer, steps: int, per_step: int) -> int:
        channel = await DeltaChannel.connect(await producer.channel_address.remote(), "bench")
        await producer.start_channel.remote(steps)
        n = 0
        while n < steps * per_step:  # a frame holds one step, or several when the reader fell behind
            n += len(await channel.read())
        channel.close()
        return n


def cpu(pid: int) -> float:
    return procfs.cpu_seconds(procfs.stat(str(pid)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-step", type=int, default=32)
    parser.add_argument("--period-ms", type=float, default=10.0)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    producer, consumer = Producer.remote(args.per_step, args.period_ms / 1e3), Consumer.remote()
    pids = ray.get([producer.pid.remote(), consumer.pid.remote()])
    ways = {"Ray stream": consumer.stream, "long poll": consumer.poll, "channel": consumer.channel}
    for method in ways.values():  # warm-up: connections, imports
        ray.get(method.remote(producer, 20, args.per_step))
    started = [cpu(p) for p in pids]
    time.sleep(args.steps * args.period_ms / 1e3)
    idle = [(cpu(p) - s) / args.steps * 1e6 for p, s in zip(pids, started)]
    print(f"{args.steps} steps of {args.per_step} deltas every {args.period_ms:g} ms; CPU us a step "
          f"(less idle: producer {idle[0]:.0f}, consumer {idle[1]:.0f})")
    results = {}
    for name, method in ways.items():
        started = [cpu(p) for p in pids]
        items = ray.get(method.remote(producer, args.steps, args.per_step))
        assert items == args.steps * args.per_step, (name, items)
        used = [(cpu(p) - s) / args.steps * 1e6 - i for p, s, i in zip(pids, started, idle)]
        results[name] = used
        print(f"  {name:<10}: producer (router) {used[0]:6.0f}, consumer (ingress) {used[1]:6.0f} us a step; "
              f"per delta {used[0] / args.per_step:.1f} + {used[1] / args.per_step:.1f}")
    channel = sum(results["channel"])
    for name in ("Ray stream", "long poll"):
        print(f"channel / {name}: {channel / sum(results[name]):.2f} of both processes' CPU a step")
    ray.shutdown()


if __name__ == "__main__":
    main()

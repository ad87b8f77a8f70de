"""What the test's driver does inside the head's network namespace (netns_cluster.py runs these
functions in its one-process pool): connect to the cluster, deploy raymoe with its expert
workers on the node namespaces, run streamed load through a router's subscription and time
every token, and read the deployment's state. State lives in this process between calls.

Ray is imported only inside the functions: the pool's initializer must enter the namespace
before anything imports it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

STATE: dict[str, Any] = {}
SUBSCRIBER = "netns-driver"


def connect() -> dict[str, Any]:
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ["NETNS_GCS_ADDRESS"], _node_ip_address=os.environ["NETNS_NODE_IP"],
                 log_to_driver=False)
    return {n["NodeID"]: {"address": n["NodeManagerAddress"], "alive": n["Alive"],
                          "resources": n["Resources"]} for n in ray.nodes()}


def nodes() -> dict[str, Any]:
    return connect()


def deploy_on_nodes(config_data: dict[str, Any], name: str) -> dict[str, Any]:
    """raymoe's own deploy, except that each expert-worker bundle also asks for a share of
    ``netns_node`` (a resource only the node namespaces have): the workers sit there, while the
    router and the controller stay on the head with the driver."""
    from raymoe.cluster import deploy as deploy_module
    from raymoe.cluster.config import parse_cluster_config

    connect()
    real = deploy_module.placement_group

    def on_nodes(bundles, *args, **kwargs):
        return real([dict(bundle, netns_node=0.01) for bundle in bundles], *args, **kwargs)

    deploy_module.placement_group = on_nodes
    try:
        deployment = deploy_module.deploy(parse_cluster_config(config_data), name=name, ready_timeout_s=60)
    finally:
        deploy_module.placement_group = real
    STATE["deployment"] = deployment
    return layout()


def layout() -> dict[str, Any]:
    """Where each router and worker runs: node address and pid."""
    import ray

    deployment = STATE["deployment"]
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    workers = ray.get([w.info.remote() for w in deployment.workers], timeout=30)
    routers = ray.get([r.info.remote() for r in deployment.routers], timeout=30)
    return {"workers": [{"pid": i["pid"], "address": address.get(i["node_id"]), "actor": w._actor_id.hex()[:12]}
                        for i, w in zip(workers, deployment.workers)],
            "routers": [{"pid": i["pid"], "address": address.get(i["node_id"])} for i in routers]}


def status() -> dict[str, Any]:
    import ray

    return ray.get(STATE["deployment"].controller.status.remote(), timeout=30)


def shutdown() -> None:
    deployment = STATE.pop("deployment", None)
    if deployment is not None:
        deployment.shutdown()


class Load:
    """Requests submitted to router 0 through one subscription, every delta's arrival time
    recorded. ``waves`` None: one wave; else waves of the same prompts, one after another
    (each once the previous one finished), until ``stop()``."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, tag: str, waves: bool = False) -> None:
        from raymoe.engine.sampling_params import SamplingParams

        self.router = STATE["deployment"].routers[0]
        self.prompts, self.tag, self.waves = prompts, tag, waves
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.ids: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        self.times: dict[str, list[float]] = {}
        self.finished: set[str] = set()
        self.failures: list[str] = []
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.changed = threading.Condition()
        self.subscriber = f"{SUBSCRIBER}-{tag}"
        self.stream = self.router.subscribe.options(num_returns="streaming").remote(self.subscriber)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.thread = threading.Thread(target=self._submit, daemon=True)
        self.thread.start()

    def _submit(self) -> None:
        import ray

        wave = 0
        while not self.failures:
            ids = [f"{self.tag}-{wave}-{i}" for i in range(len(self.prompts))]
            with self.changed:
                for rid in ids:
                    self.tokens[rid], self.times[rid] = [], []
                self.ids += ids
            ray.get([self.router.submit.remote(self.subscriber, rid, p, self.params)
                     for rid, p in zip(ids, self.prompts)])
            with self.changed:
                self.changed.wait_for(lambda: self.failures or all(rid in self.finished for rid in ids))
            wave += 1
            if not self.waves or self.stopping.is_set():
                return

    def _read(self) -> None:
        import ray

        try:
            for ref in self.stream:
                now = time.monotonic()
                batch = ray.get(ref)
                with self.changed:
                    for delta in batch:
                        rid = getattr(delta, "request_id", None)
                        if rid not in self.tokens or not hasattr(delta, "token_ids"):  # a StepFailure
                            self.failures.append(getattr(delta, "message", repr(delta))[:4000])
                            continue
                        if delta.token_ids:
                            self.tokens[rid] += list(delta.token_ids)
                            self.times[rid] += [now] * len(delta.token_ids)
                        if delta.finished:
                            self.finished.add(rid)
                    self.changed.notify_all()
                if self.failures or (not self.thread.is_alive() and len(self.finished) == len(self.ids)):
                    break
        except Exception as error:  # the stream itself failed
            with self.changed:
                self.failures.append(f"{type(error).__name__}: {error}"[:600])
                self.changed.notify_all()

    def progress(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def result(self, timeout_s: float) -> dict[str, Any]:
        self.stopping.set()
        self.thread.join(timeout_s)
        with self.changed:
            ids = list(self.ids)
            gaps = [b - a for rid in ids for a, b in zip(self.times[rid], self.times[rid][1:])]
            return {"tokens": [self.tokens[rid] for rid in ids], "finished": len(self.finished),
                    "requests": len(ids), "waves": len(ids) // max(len(self.prompts), 1),
                    "failures": list(self.failures), "timed_out": self.thread.is_alive(), "gaps": gaps,
                    "first": min((t[0] for t in self.times.values() if t), default=None),
                    "last": max((t[-1] for t in self.times.values() if t), default=None),
                    "started": self.started, "token_times": {rid: list(self.times[rid]) for rid in ids}}


def start_load(prompts: list[list[int]], max_tokens: int, tag: str, waves: bool = False) -> None:
    STATE[f"load-{tag}"] = Load(prompts, max_tokens, tag, waves)


def load_progress(tag: str) -> int:
    return STATE[f"load-{tag}"].progress()


def finish_load(tag: str, timeout_s: float) -> dict[str, Any]:
    return STATE.pop(f"load-{tag}").result(timeout_s)


def run_load(prompts: list[list[int]], max_tokens: int, tag: str, timeout_s: float) -> dict[str, Any]:
    start_load(prompts, max_tokens, tag)
    return finish_load(tag, timeout_s)


def monotonic() -> float:
    return time.monotonic()


def diagnose() -> dict[str, Any]:
    """What a failed test prints: the controller's status, each router's info and telemetry
    counters, and where every actor of the deployment is (Ray's state API)."""
    import ray

    deployment = STATE.get("deployment")
    report: dict[str, Any] = {}
    if deployment is None:
        return report
    for key, call in (("status", lambda: deployment.controller.status.remote()),
                      ("routers", lambda: [r.info.remote() for r in deployment.routers])):
        try:
            report[key] = ray.get(call(), timeout=10)
        except Exception as error:
            report[key] = f"{type(error).__name__}: {error}"[:500]
    infos = []
    for worker in deployment.workers:
        try:
            info = ray.get(worker.info.remote(), timeout=5)
            infos.append((worker._actor_id.hex()[:12], info["pid"], info["node_id"][:8]))
        except Exception as error:
            infos.append((worker._actor_id.hex()[:12], f"{type(error).__name__}: {error}"[:200]))
    report["workers"] = infos
    report["nodes"] = [(n["NodeID"][:8], n["NodeManagerAddress"], n["Alive"]) for n in ray.nodes()]
    return report

"""A Ray cluster over Linux network namespaces on this machine: a head and nodes, each in a
namespace of its own with its own address on a veth, joined by a bridge that lives in a
namespace of its own too (nothing is added to the host's namespace, so no address, route or
listener of the cluster is reachable from it, and two runs at once cannot collide).

    bridge namespace  {prefix}-br: bridge br0, one veth end per member (v-<member>)
    member namespaces {prefix}-head, {prefix}-node1, ...: eth0 with 10.231.0.<n>/24, lo up

Each member runs `ray start` through `ip netns exec` with `--node-ip-address` its own address and
a custom resource named after it (``netns_head``, ``netns_node1``, ...; nodes also carry
``netns_node``), under a temp dir of the cluster's own. The test's driver runs in the head
namespace: a child process (spawned, single-threaded at the time) enters that namespace with
setns(2) before it imports Ray, and the test calls functions in it (``NetnsCluster.driver``, a
one-process pool). Faults: ``delay`` (tc netem on a member's link), ``cut``/``heal`` (its link
down/up, a partition), ``kill`` (SIGKILL of every process in its namespace).

Clean-up kills the processes inside the cluster's namespaces (found by their network
namespace, by pid) and deletes the namespaces, which removes every veth and the bridge; it runs
even when a test fails, and ``cleanup_stale`` removes what a killed run left behind.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import multiprocessing
import secrets
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

SUBNET = "10.231.0"  # private /24, only inside the bridge's namespace and the members'
PREFIX_ROOT = "rmns"  # every namespace this module makes starts with it
CLONE_NEWNET = 0x40000000
GCS_PORT = 6379  # inside the head namespace: nothing else listens there
HEALTH_CHECK_FAILURES = 5  # failed health checks before Ray's GCS declares a node dead (Ray's default)


def _run(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=timeout)


def why_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (tried for real)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    if os.geteuid() != 0:
        return f"needs root (CAP_NET_ADMIN) for `ip netns`; running as uid {os.geteuid()}"
    probe = f"{PREFIX_ROOT}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: `ip netns add` said {made.stderr.strip() or made.returncode}"
    try:
        link = _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if link.returncode != 0:
            return f"cannot create a veth pair in a namespace: {link.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _ns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def pids_in_namespace(name: str) -> list[int]:
    """Every process whose network namespace is ``name`` (by the namespace file's inode)."""
    inode = _ns_inode(name)
    if inode is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                pids.append(int(entry))
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return pids


def kill_namespace_processes(name: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process in namespace ``name``; returns their pids once they are gone."""
    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = [p for p in pids_in_namespace(name) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return sorted(set(killed))


def cleanup_stale() -> None:
    """Remove namespaces a killed earlier run of this module left (their owner pid is gone)."""
    listing = _run("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        if not name.startswith(PREFIX_ROOT) or "-" not in name:
            continue
        owner = name[len(PREFIX_ROOT):].split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            kill_namespace_processes(name, wait_s=5.0)
            _run("ip", "netns", "del", name, check=False)


@dataclass
class Member:
    name: str  # head, node1, node2
    namespace: str
    address: str
    bridge_port: str  # its veth's end in the bridge's namespace
    resources: dict[str, float] = field(default_factory=dict)


def _enter_namespace(namespace: str, env: dict[str, str]) -> None:
    """Pool initializer: this (fresh, single-threaded) process moves into ``namespace``."""
    os.environ.update(env)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


class NetnsCluster:
    """A head and ``nodes`` nodes in namespaces, a Ray cluster over them, a driver in the head's."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 2) -> None:
        self.prefix = f"{PREFIX_ROOT}{os.getpid()}"
        self.bridge_ns = f"{self.prefix}-br"
        names = ["head"] + [f"node{i}" for i in range(1, nodes + 1)]
        self.members = {
            name: Member(name, f"{self.prefix}-{name}", f"{SUBNET}.{i + 1}", f"v-{name}",
                         {f"netns_{name}": 1.0, **({"netns_node": 1.0} if name != "head" else {})})
            for i, name in enumerate(names)}
        self.cpus_per_node = cpus_per_node
        self.temp_dir = tempfile.mkdtemp(prefix="raymoe-netns-")
        self.driver: concurrent.futures.ProcessPoolExecutor | None = None
        self.started = False
        self.head_env: dict[str, str] = {}
        self.delays: dict[str, subprocess.Popen | None] = {}  # member -> its delay relay (None: netem)
        # Ray 2.60 authenticates with a token: this cluster's own, which every member and the
        # driver get, so the host's ~/.ray/auth_token is neither needed nor used.
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}

    # ---- namespaces and links ---------------------------------------------------------------
    def create_network(self) -> None:
        _run("ip", "netns", "add", self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        _run("ip", "-n", self.bridge_ns, "link", "set", "lo", "up")
        for member in self.members.values():
            _run("ip", "netns", "add", member.namespace)
            # both ends made in the bridge's namespace, one moved into the member's as eth0
            _run("ip", "-n", self.bridge_ns, "link", "add", member.bridge_port, "type", "veth",
                 "peer", "name", "eth0", "netns", member.namespace)
            _run("ip", "-n", self.bridge_ns, "link", "set", member.bridge_port, "master", "br0")
            _run("ip", "-n", self.bridge_ns, "link", "set", member.bridge_port, "up")
            _run("ip", "-n", member.namespace, "addr", "add", f"{member.address}/24", "dev", "eth0")
            _run("ip", "-n", member.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", member.namespace, "link", "set", "lo", "up")

    def namespaces(self) -> list[str]:
        return [m.namespace for m in self.members.values()] + [self.bridge_ns]

    # ---- Ray -----------------------------------------------------------------------------------
    def ray_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Inside the namespaces Ray binds each member's own address (reachable only here).
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        env.pop("RAY_ADDRESS", None)
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        env.update(self.auth_env)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    @property
    def head(self) -> Member:
        return self.members["head"]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def _ray_start(self, member: Member, *extra: str) -> None:
        args = ["ip", "netns", "exec", member.namespace, sys.executable, "-m", "ray.scripts.scripts", "start",
                f"--node-ip-address={member.address}", f"--num-cpus={self.cpus_per_node}",
                f"--resources={json.dumps(member.resources)}", "--object-store-memory=100000000",
                "--disable-usage-stats", *extra]
        env = dict(self.ray_env(), **(self.head_env if member.name == "head" else {}))
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"ray start in {member.namespace} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def start_ray(self) -> None:
        # Ray's GCS declares a node dead after HEALTH_CHECK_FAILURES failed health checks; a
        # node declared dead never rejoins (its raylet exits once it hears so). A check of a
        # partitioned node fails only at its 10 s deadline (one of a dead raylet, refused, at
        # once), so Ray's defaults keep a 20 s partition a partition; set here to say so.
        self.head_env = {"RAY_health_check_failure_threshold": str(HEALTH_CHECK_FAILURES)}
        self._ray_start(self.head, "--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                        f"--temp-dir={self.temp_dir}")
        for member in self.members.values():
            if member.name != "head":
                self._ray_start(member, f"--address={self.gcs_address}")
        self.started = True

    def start_driver(self) -> concurrent.futures.ProcessPoolExecutor:
        env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0",
               "NETNS_GCS_ADDRESS": self.gcs_address, "NETNS_NODE_IP": self.head.address, **self.auth_env}
        self.driver = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_enter_namespace, initargs=(self.head.namespace, env))
        return self.driver

    def call(self, function, *args, timeout: float = 300.0, **kwargs):
        """Run ``function(*args, **kwargs)`` in the driver (the head's namespace); its result."""
        assert self.driver is not None
        return self.driver.submit(function, *args, **kwargs).result(timeout=timeout)

    def submit(self, function, *args, **kwargs) -> concurrent.futures.Future:
        assert self.driver is not None
        return self.driver.submit(function, *args, **kwargs)

    # ---- faults -----------------------------------------------------------------------------------
    def delay(self, name: str, ms: float) -> str:
        """``ms`` of delay each way on ``name``'s link. With sch_netem: netem on both ends of its
        veth. Without (this machine's kernel has none): its bridge port leaves the bridge and
        delay_relay.py forwards between it and a new veth into the bridge, holding each frame
        ``ms``. Returns which of the two ("netem" or "relay")."""
        member = self.members[name]
        netem = _run("ip", "netns", "exec", member.namespace, "tc", "qdisc", "replace", "dev", "eth0", "root",
                     "netem", "delay", f"{ms}ms", check=False)
        if netem.returncode == 0:
            _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "replace", "dev", member.bridge_port,
                 "root", "netem", "delay", f"{ms}ms")
            self.delays[name] = None
            return "netem"
        inner, outer = f"d-{name}", f"e-{name}"
        _run("ip", "-n", self.bridge_ns, "link", "add", inner, "type", "veth", "peer", "name", outer)
        for link in (inner, outer):
            _run("ip", "-n", self.bridge_ns, "link", "set", link, "up", "promisc", "on")
        _run("ip", "-n", self.bridge_ns, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.bridge_ns, "link", "set", member.bridge_port, "nomaster", "promisc", "on")
        relay = subprocess.Popen(
            ["ip", "netns", "exec", self.bridge_ns, sys.executable,
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_relay.py"),
             member.bridge_port, inner, str(ms)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.delays[name] = relay
        line = relay.stdout.readline() if relay.stdout else ""
        if "relay ready" not in line:
            self.clear_delay(name)
            raise RuntimeError(f"delay relay for {name} did not start: {line}")
        return "relay"

    def clear_delay(self, name: str) -> None:
        member = self.members[name]
        relay = self.delays.pop(name, None)
        if relay is None:
            _run("ip", "netns", "exec", member.namespace, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "del", "dev", member.bridge_port, "root",
                 check=False)
            return
        relay.kill()  # the relay this object started (`ip netns exec` execs it: the same pid)
        relay.wait(10)
        _run("ip", "-n", self.bridge_ns, "link", "del", f"d-{name}", check=False)  # and its peer
        _run("ip", "-n", self.bridge_ns, "link", "set", member.bridge_port, "promisc", "off", "master", "br0")

    def cut(self, name: str) -> None:
        """Partition ``name``: its link's bridge end goes down (packets to and from it are lost;
        its processes live on, their connections stay open on their side)."""
        _run("ip", "-n", self.bridge_ns, "link", "set", self.members[name].bridge_port, "down")

    def heal(self, name: str) -> None:
        _run("ip", "-n", self.bridge_ns, "link", "set", self.members[name].bridge_port, "up")

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process in ``name``'s namespace (its raylet and every actor there)."""
        return kill_namespace_processes(self.members[name].namespace)

    def restart_node(self, name: str) -> None:
        """`ray start` again on a node whose processes were killed."""
        self._ray_start(self.members[name], f"--address={self.gcs_address}")

    def pids(self, name: str) -> list[int]:
        return pids_in_namespace(self.members[name].namespace)

    def tcp_peers(self, name: str) -> list[tuple[str, int, str, int, int]]:
        """Established TCP connections in ``name``'s namespace: (local ip, port, remote ip, port, pid)."""
        out = _run("ip", "netns", "exec", self.members[name].namespace, "ss", "-tnpH", "state", "established").stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            local, remote = parts[2], parts[3]
            pids = [int(p.split("=")[1]) for p in line.replace(")", ",").split(",") if p.startswith("pid=")]
            lhost, lport = local.rsplit(":", 1)
            rhost, rport = remote.rsplit(":", 1)
            for pid in pids or [0]:
                rows.append((lhost, int(lport), rhost, int(rport), pid))
        return rows

    # ---- clean-up ---------------------------------------------------------------------------------
    def cleanup(self) -> None:
        for relay in self.delays.values():
            if relay is not None and relay.poll() is None:
                relay.kill()
        self.delays.clear()
        if self.driver is not None:
            for process in list(getattr(self.driver, "_processes", {}).values()):
                try:
                    os.kill(process.pid, signal.SIGKILL)  # the driver child this object spawned
                except (ProcessLookupError, AttributeError):
                    pass
            self.driver.shutdown(wait=False, cancel_futures=True)
            self.driver = None
        for namespace in self.namespaces():
            kill_namespace_processes(namespace)
        for namespace in self.namespaces():
            _run("ip", "netns", "del", namespace, check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "NetnsCluster":
        try:
            self.create_network()
            self.start_ray()
            self.start_driver()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

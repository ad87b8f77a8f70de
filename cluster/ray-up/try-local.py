#!/usr/bin/env python3
"""Launch check: cluster/ray-up/local.yaml, as shipped, on this one machine over loopback SSH.

    python cluster/ray-up/try-local.py [--keep] [--bystander-pids "PID ..."]

Run it from anywhere, as a user who may run sshd (root: the privilege-separation directory
/run/sshd must exist or be creatable), with raymoe installed in the running Python
(`pip install -e .`), and sshd, ssh, ssh-keygen, rsync and python3 (with venv) on the PATH.
Every listener is on 127.0.0.1. In order:

1. a bystander: an ordinary Ray cluster (`ray start --head`, its own temp dir) that is not
   this launch's and must outlive it (or, with --bystander-pids, processes someone else
   started for the same purpose);
2. sshd on 127.0.0.1 only, on a free port, accepting one fresh key; the sessions it opens
   get a fresh home directory (`SetEnv HOME`: the "remote host" starts empty, as a new
   machine would) and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray on loopback);
3. local.yaml with its placeholders filled for loopback (head_ip 127.0.0.1, no workers, this
   user, the key, an ssh_proxy_command for the port, a token of its own) and, so that it
   cannot collide with anything on the machine, a cluster name and GCS port of its own;
   every other line as shipped;
4. `ray up`; then, as on the head, `~/.raymoe/venv/bin/raymoe serve --address ADDRESS` (ADDRESS
   from the head's ray_current_cluster; the demo checkpoint); every listening socket of sshd,
   the cluster and `raymoe serve` on loopback, but for Ray Serve's replica gRPC server, which
   Ray Serve 2.60 binds to every interface (reported); a completion, `raymoe status --address
   ...`, and the same with a wrong token (must say "authentication failed"); SIGTERM to
   `raymoe serve` (exit 0);
5. `ray down`; then every process of the cluster recorded before it must be gone (by its
   marker and descendants, and by its temp dir on the command line) and every bystander
   process alive, the bystander cluster still running a task.

It prints one JSON line of timings (seconds: ray_up, ready, first_completion, ray_down,
total) and exits 0 when all held. Whatever happens it stops what it started (sshd and its
sessions, the cluster, `raymoe serve`, its own bystander) and removes its files (--keep
leaves the work directory). Every step has a timeout; a full run takes 3-5 minutes, most of
it `pip install` into the cluster's fresh virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from raymoe.cluster import procfs
from raymoe.cluster.serve_process import READY_LINE, ServeProcess
from raymoe.kernels.comm.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIPPED = HERE / "local.yaml"
SHIPPED_NAME = "raymoe-onprem"
SHIPPED_PORT = "6379"

RELAY = """\
import os, socket, sys, threading
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def upstream():
    while True:
        data = os.read(0, 65536)
        if not data:
            break
        sock.sendall(data)
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=upstream, daemon=True).start()
out = sys.stdout.buffer
while True:
    data = sock.recv(65536)
    if not data:
        break
    out.write(data)
    out.flush()
"""


class Failed(Exception):
    pass


def log(message: str) -> None:
    print(f"[try-local {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise Failed(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


# ---- processes ---------------------------------------------------------------------------

def identities(pids: set[int], table: dict[int, procfs.Process]) -> dict[int, int]:
    """pid -> start time: a pid that is reused later is not mistaken for the same process."""
    return {pid: table[pid].start_time for pid in pids if pid in table}


def still_running(ids: dict[int, int]) -> dict[int, str]:
    table = procfs.processes()
    return {pid: table[pid].command[:100] for pid, start in ids.items()
            if pid in table and table[pid].start_time == start and table[pid].state != "Z"}


def listening_addresses(pids) -> dict[str, int]:
    """"host:port" -> pid for every TCP socket in LISTEN state held by ``pids``."""
    inodes = {}
    for pid in pids:
        try:
            inodes.update(dict.fromkeys(procfs.socket_inodes(pid), pid))
        except OSError:
            continue
    return {f"{address}:{port}": inodes[inode] for address, port, inode in procfs.tcp_sockets(procfs.TCP_LISTEN)
            if inode in inodes}


def loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def processes_mentioning(text: str) -> set[int]:
    table = procfs.processes()
    return procfs.descendants({pid for pid, process in table.items() if text in process.command}, table)


def terminate(pids, grace_s: float = 10.0) -> None:
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(procfs.exists(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- the launch --------------------------------------------------------------------------

class Launch:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.python = args.python
        self.work = Path(tempfile.mkdtemp(prefix="raymoe-try-", dir="/tmp"))
        self.home = self.work / "home"
        self.name = f"raymoe-try-{os.getpid()}"
        self.gcs_port = free_port()
        self.serve_port = free_port()
        self.ssh_port = free_port()
        self.ray_temp = f"/tmp/ray-{self.name}"
        self.sshd: subprocess.Popen | None = None
        self.serve: ServeProcess | None = None
        self.bystander_temp: str | None = None
        self.bystander_ids: dict[int, int] = {}
        self.bystander_address: str | None = None
        self.timings: dict[str, float] = {}
        self.beyond_loopback: list[str] = []
        self.env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")

    # -- helpers
    def run(self, cmd: list[str], timeout_s: float, what: str, env=None, check=True, cwd=None) -> subprocess.CompletedProcess:
        log(f"{what}: {' '.join(cmd)}")
        try:
            result = subprocess.run(cmd, env=env or self.env, cwd=cwd, timeout=timeout_s, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except subprocess.TimeoutExpired as error:
            out = error.stdout if isinstance(error.stdout, str) else (error.stdout or b"").decode(errors="replace")
            raise Failed(f"{what} did not finish in {timeout_s} s; its output ended with:\n{out[-4000:]}") from None
        with open(self.work / "commands.log", "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{result.stdout}\n[rc {result.returncode}]\n")
        if check and result.returncode != 0:
            raise Failed(f"{what} exited {result.returncode}; its output ended with:\n{result.stdout[-4000:]}")
        return result

    def ray(self, *argv: str) -> list[str]:
        return [self.python, "-m", "ray.scripts.scripts", *argv]

    def venv(self, program: str) -> str:
        return str(self.home / ".raymoe" / "venv" / "bin" / program)

    def head_env(self, **extra) -> dict:
        """The environment of a login on the "head": its home, its venv, Ray on loopback."""
        env = {k: v for k, v in self.env.items() if not k.startswith("RAY_AUTH")}
        env.update(HOME=str(self.home), RAYMOE_CACHE=str(self.work / "cache"), **extra)
        return env

    # -- 1. bystander
    def start_bystander(self) -> None:
        if self.args.bystander_pids:
            table = procfs.processes()
            pids = {int(p) for p in self.args.bystander_pids.split()}
            missing = pids - set(table)
            if missing:
                raise Failed(f"bystander pids not running before the launch: {sorted(missing)}")
            self.bystander_ids = identities(pids, table)
            return
        self.bystander_temp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")
        port = free_port()
        self.run(self.ray("start", "--head", f"--port={port}", f"--temp-dir={self.bystander_temp}", "--num-cpus=1",
                          "--include-dashboard=false", "--disable-usage-stats"), 120, "bystander ray start")
        self.bystander_address = f"127.0.0.1:{port}"
        time.sleep(2)  # its raylet's agents
        table = procfs.processes()
        pids = procfs.descendants({p for p, i in table.items() if self.bystander_temp in i.command}, table)
        self.bystander_ids = identities(pids, table)
        log(f"bystander cluster at {self.bystander_address}: {len(pids)} processes")

    # -- 2. sshd
    def start_sshd(self) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for tool in (sshd, "ssh", "ssh-keygen", "rsync"):
            if not shutil.which(tool):
                raise Failed(f"{tool} not found (Debian: apt-get install openssh-server openssh-client rsync)")
        if os.getuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        self.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.work / "host_key")], 30, "host key")
        self.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.work / "id_ed25519")], 30, "user key")
        shutil.copy(self.work / "id_ed25519.pub", self.work / "authorized_keys")
        shutil.copytree("/etc/skel", self.home, dirs_exist_ok=True) if Path("/etc/skel").is_dir() else self.home.mkdir()
        self.home.mkdir(exist_ok=True)
        # This machine's pip settings, as the "remote host" is this machine (local wheels,
        # indexes and the cache: without them a fresh venv downloads torch from PyPI).
        for rel in (".config/pip/pip.conf", ".pip/pip.conf"):
            src = Path.home() / rel
            if src.is_file():
                (self.home / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, self.home / rel)
        setenv = {"HOME": str(self.home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        setenv.update({k: v for k, v in os.environ.items() if k.startswith("PIP_") and '"' not in v})
        setenv.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
        config = self.work / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.ssh_port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.work / 'host_key'}",
            f"AuthorizedKeysFile {self.work / 'authorized_keys'}",
            "PidFile none",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            "LogLevel ERROR",
            "MaxSessions 64",
            "MaxStartups 64",
            "SetEnv " + " ".join(f'"{k}={v}"' for k, v in setenv.items()),
            "",
        ]))
        self.run([sshd, "-t", "-f", str(config)], 30, "sshd config check")
        log(f"sshd on 127.0.0.1:{self.ssh_port}")
        self.sshd = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=open(self.work / "sshd.log", "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port(self.ssh_port, 30)
        (self.work / "relay.py").write_text(RELAY)

    # -- 3. the file
    def fill_yaml(self) -> Path:
        text = SHIPPED.read_text()
        text = text.replace(SHIPPED_NAME, self.name).replace(SHIPPED_PORT, str(self.gcs_port))
        config = yaml.safe_load(text)
        starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        if config["cluster_name"] != self.name or sum(str(self.gcs_port) in c for c in starts) != 2:
            raise Failed(f"{SHIPPED} no longer names {SHIPPED_NAME} and port {SHIPPED_PORT} where this check expects")
        config["provider"]["head_ip"] = "127.0.0.1"
        config["provider"]["worker_ips"] = []
        config["max_workers"] = 0
        node_type = config["available_node_types"][config["head_node_type"]]
        node_type["min_workers"] = node_type["max_workers"] = 0
        config["auth"] = {
            "ssh_user": subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip(),
            "ssh_private_key": str(self.work / "id_ed25519"),
            "ssh_proxy_command": f"{sys.executable} {self.work / 'relay.py'} %h {self.ssh_port}",
        }
        token = self.work / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        mounts = config["file_mounts"]
        assert mounts.pop("~/.ray/auth_token") == "~/.ray/auth_token"
        mounts["~/.ray/auth_token"] = str(token)
        path = self.work / "local.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # -- 4. serve, a completion, status
    def serve_and_ask(self) -> None:
        # as docs/DEPLOY.md says to on the head: the address `ray start --head` wrote down
        address = Path(self.ray_temp, "ray_current_cluster").read_text().strip()
        if address != f"127.0.0.1:{self.gcs_port}":
            raise Failed(f"the head's GCS is at {address}, not 127.0.0.1:{self.gcs_port}: not on loopback")
        log_path = self.work / "serve.log"
        cmd = [self.venv("raymoe"), "serve", "--address", address, "--host", "127.0.0.1", "--port", str(self.serve_port)]
        log(" ".join(cmd))
        start = time.monotonic()
        self.serve = ServeProcess(cmd, self.serve_port, log_path=str(log_path), env=self.head_env())
        self.serve.start()
        try:  # ready once it says so in its log
            self.serve.wait_ready(self.args.ready_timeout, probe=None, ready_line=READY_LINE)
        except RuntimeError as error:  # it exited, or was not ready in time
            raise Failed(str(error)) from None
        self.timings["ready"] = time.monotonic() - start
        listeners = listening_addresses(set(self.cluster_ids()) | {self.sshd.pid, self.serve.process.pid})
        table = procfs.processes()
        exposed = {a: (table[p].command if p in table else "").strip()[:100] or str(p)
                   for a, p in listeners.items() if not loopback(a)}
        # Ray Serve 2.60 itself: every replica opens its inter-deployment gRPC server on "[::]:0"
        # (hardcoded in ray/serve/_private/replica.py); reported, and nothing else is allowed.
        serves = {a: c for a, c in exposed.items() if c.startswith("ray::ServeReplica")}
        if set(exposed) - set(serves):
            raise Failed(f"listening beyond loopback: {exposed}")
        log(f"{len(listeners) - len(serves)} of {len(listeners)} listening sockets of sshd, the cluster and raymoe "
            f"serve are on loopback; the rest are Ray Serve's replica gRPC servers on every interface: {serves}")
        self.beyond_loopback = sorted(serves)
        start = time.monotonic()
        body = json.dumps({"model": "demo-mixtral", "prompt": "Hello world", "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(f"http://127.0.0.1:{self.serve_port}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        self.timings["first_completion"] = time.monotonic() - start
        if not answer["choices"] or answer["usage"]["completion_tokens"] < 1:
            raise Failed(f"completion without tokens: {answer}")
        log(f"completion: {answer['choices'][0]['text']!r} ({answer['usage']['completion_tokens']} tokens)")
        status = self.run([self.venv("raymoe"), "status", "--address", address], 120, "raymoe status", env=self.head_env())
        if "balancedness" not in status.stdout:
            raise Failed(f"raymoe status printed no placement:\n{status.stdout}")
        print(status.stdout, file=sys.stderr)
        bad_token = self.work / "wrong_token"
        bad_token.write_text(secrets.token_hex(32))
        wrong = self.run([self.venv("raymoe"), "status", "--address", address], 120, "raymoe status, wrong token",
                         env=self.head_env(RAY_AUTH_TOKEN_PATH=str(bad_token)), check=False)
        if wrong.returncode == 0 or "authentication failed" not in wrong.stdout:
            raise Failed(f"raymoe status with a wrong token did not say 'authentication failed':\n{wrong.stdout}")
        log("wrong token: " + next(line for line in wrong.stdout.splitlines() if "authentication failed" in line)[:160])
        self.serve.process.send_signal(signal.SIGTERM)
        try:
            code = self.serve.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise Failed("raymoe serve did not exit within 120 s of SIGTERM") from None
        if code != 0:
            raise Failed(f"raymoe serve exited {code} on SIGTERM:\n{log_path.read_text()[-4000:]}")

    def cluster_ids(self) -> dict[int, int]:
        from raymoe.cluster.ray_up_node import cluster_processes

        table = procfs.processes()
        pids = set(cluster_processes(self.name)) | procfs.descendants(
            {p for p, i in table.items() if self.ray_temp + "/" in i.command}, table)
        return identities(pids, table)

    def check_bystander(self) -> None:
        alive = still_running(self.bystander_ids)
        gone = set(self.bystander_ids) - set(alive)
        if gone:
            raise Failed(f"bystander processes stopped by the launch or `ray down`: {sorted(gone)}")
        if self.bystander_address:
            probe = ("import ray; from raymoe.cluster.ray_connect import connect; "
                     "connect(%r, logging_level='ERROR', log_to_driver=False); "
                     "print('bystander answers', ray.get(ray.remote(lambda: 41 + 1).remote()))") % self.bystander_address
            result = self.run([self.python, "-c", probe], 120, "bystander task", check=False)
            if "bystander answers 42" not in result.stdout:
                raise Failed(f"the bystander cluster no longer runs tasks:\n{result.stdout[-3000:]}")
        log(f"bystander: all {len(self.bystander_ids)} processes alive")

    def main(self) -> dict:
        total = time.monotonic()
        self.start_bystander()
        self.start_sshd()
        config = self.fill_yaml()
        start = time.monotonic()
        self.run(self.ray("up", "-y", "--no-config-cache", str(config)), self.args.up_timeout, "ray up", cwd=REPO)
        self.timings["ray_up"] = time.monotonic() - start
        before = self.cluster_ids()
        log(f"cluster {self.name} is up: {len(before)} processes")
        if not before:
            raise Failed("ray up returned but no process of the cluster runs")
        self.serve_and_ask()
        ids = self.cluster_ids()
        ids.update(before)
        log(f"ray down; the cluster has {len(still_running(ids))} processes")
        start = time.monotonic()
        self.run(self.ray("down", "-y", str(config)), self.args.down_timeout, "ray down", cwd=REPO)
        self.timings["ray_down"] = time.monotonic() - start
        deadline = time.monotonic() + 15  # processes that got SIGTERM from their raylet
        while still_running(ids) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = still_running(ids)
        left.update({p: "" for p in self.cluster_ids()})
        if left:
            raise Failed(f"`ray down` left {len(left)} processes of the cluster running: {left}")
        log("ray down: every process of the cluster is gone")
        self.check_bystander()
        self.timings["total"] = time.monotonic() - total
        return {k: round(v, 1) for k, v in self.timings.items()}

    def cleanup(self) -> None:
        if self.serve and self.serve.process and self.serve.process.poll() is None:
            terminate([self.serve.process.pid])
        try:
            from raymoe.cluster.ray_up_node import stop

            stop(self.name, grace_s=5)
        except Exception as error:  # keep cleaning
            log(f"cleanup: {error}")
        left = self.cluster_ids()
        if left:
            terminate(list(left))
        if self.sshd:
            table = procfs.processes()
            sessions = procfs.descendants({self.sshd.pid}, table) - {self.sshd.pid}
            terminate([self.sshd.pid])
            terminate(sessions, grace_s=5)
            self.sshd.wait(timeout=10)
        # ssh clients of `ray up`/`ray down` (ControlPersist masters) and their relays
        terminate(processes_mentioning(str(self.work / "relay.py")), grace_s=5)
        if self.bystander_temp:
            table = procfs.processes()
            pids = procfs.descendants({p for p, i in table.items() if self.bystander_temp in i.command}, table)
            terminate([p for p in pids if table[p].command.split(" ")[0].endswith("raylet")], grace_s=5)
            terminate(pids, grace_s=5)
            shutil.rmtree(self.bystander_temp, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.ray_temp, ignore_errors=True)
        for suffix in (".state", ".lock"):
            Path(f"/tmp/ray/cluster-{self.name}{suffix}").unlink(missing_ok=True)
        if self.args.keep:
            log(f"kept {self.work} and the cluster's Ray logs in {self.ray_temp}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, the filled file) and the cluster's Ray temp dir")
    parser.add_argument("--bystander-pids", default="", help="processes that must outlive the launch (default: start a Ray cluster)")
    parser.add_argument("--python", default=sys.executable, help="the Python whose `ray` runs ray up/down (raymoe installed)")
    parser.add_argument("--up-timeout", type=float, default=480)
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--down-timeout", type=float, default=120)
    args = parser.parse_args()
    launch = Launch(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        timings = launch.main()
    except Failed as error:
        log(f"FAILED: {error}")
        return 1
    finally:
        launch.cleanup()
    print(json.dumps({"launch": "ok", "seconds": timings,
                      "ray_serve_replica_listeners_on_every_interface": launch.beyond_loopback}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An emulated cluster of K nodes on one Linux machine.

One network namespace per node, each joined to a bridge in the root namespace
by a veth pair whose in-node end is shaped with `tc` (bandwidth, optional
latency). Ranks inside a node talk over its loopback (the fast "intra-node"
path); ranks on different nodes cross the shaped veth (the slow "inter-node"
link). The root-side veth counters give the bytes that really left each node,
independently of zppc's ledger. Needs root and iproute2; everything created is
removed on exit, error or Ctrl-C.

With `cpu_per_rank`, each rank also runs in a cgroup of its own (cgroup v1's
cpu controller) whose CFS quota holds it to that share of a core, as a rank
on a real cluster has its own device: a rank computes at the same speed
whether its peers compute or wait, and cannot borrow the cores its waiting
peers leave (its gloo threads share its quota too). Without it the ranks
share the host's cores freely. (At 2 x 2 and 40 Mbit/s the quota brought
zppc no closer to hiding its communication: RESULTS' forty-fourth run.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


class ClusterError(RuntimeError):
    pass


RESULT_PREFIX = "RESULT "
CPU_SHARE_ENV = "ZPPC_BENCH_CPU_SHARE_DIR"
CPU_PERIOD_US = 10_000  # short, so a throttled rank waits at most a few ms for its next share


def result_lines(outputs: list[str]) -> list[dict]:
    """The JSON a job's ranks printed after `RESULT_PREFIX`, every node's, in order."""
    return [
        json.loads(line.removeprefix(RESULT_PREFIX))
        for out in outputs
        for line in out.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]


def require_privileges() -> None:
    """Refuse early, with a message that says what is missing."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs {' and '.join(missing)} (package iproute2)")
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root (it creates network namespaces and shapes links)"
        )


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise ClusterError(f"{' '.join(args)} failed: {done.stderr.strip()}")


@dataclass
class EmulatedCluster:
    """`with EmulatedCluster(nodes=2, rate="1gbit") as c:` then `c.launch(...)`."""

    nodes: int
    rate: str
    latency: str | None = None
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}")
    subnet: str = "10.213.77"
    cpu_per_rank: float | None = None
    created: list[tuple[str, str]] = field(default_factory=list)
    cpu_mount: Path | None = field(default=None, init=False, repr=False)

    def namespace(self, node: int) -> str:
        return f"zppc{self.tag}n{node}"

    def node_link(self, node: int) -> str:
        return f"zp{self.tag}n{node}"  # inside the node, shaped

    def root_link(self, node: int) -> str:
        return f"zv{self.tag}n{node}"  # root side, counted

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    @property
    def bridge(self) -> str:
        return f"zbr{self.tag}"

    def __enter__(self) -> EmulatedCluster:
        require_privileges()
        self._old_handlers = {
            s: signal.signal(s, self._interrupted) for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _interrupted(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def _build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for node in range(self.nodes):
            ns, inner, outer = self.namespace(node), self.node_link(node), self.root_link(node)
            _run("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self.created.append(("link", outer))
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            in_ns = ("ip", "netns", "exec", ns)
            _run(*in_ns, "ip", "addr", "add", f"{self.address(node)}/24", "dev", inner)
            _run(*in_ns, "ip", "link", "set", inner, "up")
            _run(*in_ns, "ip", "link", "set", "lo", "up")
            qdisc = (*in_ns, "tc", "qdisc", "add", "dev", inner)
            tbf = ("tbf", "rate", self.rate, "burst", "64kb", "latency", "100ms")
            if self.latency:  # netem delays, then tbf shapes
                _run(*qdisc, "root", "handle", "1:", "netem", "delay", self.latency)
                _run(*qdisc, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _run(*qdisc, "root", *tbf)

    def close(self) -> None:
        for kind, name in reversed(self.created):
            if kind == "mount":
                subprocess.run(("umount", name), capture_output=True)
            if kind in ("cgroup", "mount"):  # a cgroup is empty by then: its rank has exited
                with contextlib.suppress(OSError):
                    os.rmdir(name)
                continue
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            subprocess.run(cmd, capture_output=True)
        self.created.clear()
        for sig, handler in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, handler)

    def exists(self) -> bool:
        """Whether any of this cluster's namespaces is still there."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(self.namespace(n) in listed for n in range(self.nodes))

    def bytes_left_nodes(self) -> int:
        """Bytes that have left all nodes so far (root-side veth receive counters)."""
        total = 0
        for node in range(self.nodes):
            with open(f"/sys/class/net/{self.root_link(node)}/statistics/rx_bytes") as f:
                total += int(f.read())
        return total

    def exec_args(self, node: int, env: dict[str, str]) -> list[str]:
        """Command prefix that runs inside `node` with gloo bound to its link."""
        assignments = [
            f"{k}={v}" for k, v in {**env, "GLOO_SOCKET_IFNAME": self.node_link(node)}.items()
        ]
        return ["ip", "netns", "exec", self.namespace(node), "env", *assignments]

    def cpu_shares(self, world: int) -> dict[str, str]:
        """One cpu cgroup per rank, each with a quota of `cpu_per_rank` cores
        (made once per world size); the environment that tells a rank where
        to join (`join_cpu_share`). Empty without `cpu_per_rank`. The cpu
        hierarchy is mounted again outside /sys, which `ip netns exec`
        replaces with the namespace's own."""
        if self.cpu_per_rank is None:
            return {}
        if self.cpu_mount is None:
            mount = tempfile.mkdtemp(prefix="zppc-cpu-")
            self.created.append(("mount", mount))
            done = subprocess.run(
                ["mount", "-t", "cgroup", "-o", "cpu", "cgroup", mount],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise ClusterError(
                    f"--cpu-per-rank needs cgroup v1's cpu controller: {done.stderr.strip()}"
                )
            self.cpu_mount = Path(mount)
        root = self.cpu_mount / f"zppc{self.tag}"
        quota = max(1000, round(self.cpu_per_rank * CPU_PERIOD_US))
        for path in [root, *(root / f"r{rank}" for rank in range(world))]:
            if path.exists():
                continue
            path.mkdir()
            self.created.append(("cgroup", str(path)))
            if path != root:
                (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
        return {CPU_SHARE_ENV: str(root)}

    def measure_link(self, nbytes: int = 4 << 20) -> float:
        """Bits per second measured by sending `nbytes` from node 0 to node 1
        (timed on the receiver, from first to last byte)."""
        port = 29000 + int(self.tag) % 1000
        receiver = (
            "import socket,time\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.address(1)}',{port}));s.listen(1)\n"
            "c,_=s.accept();n=0;t0=None\n"
            "while True:\n"
            " d=c.recv(1<<20)\n"
            " if not d: break\n"
            " t0=t0 or time.perf_counter();n+=len(d)\n"
            "print(n,time.perf_counter()-t0)\n"
        )
        sender = (
            "import socket,time\n"
            "for _ in range(100):\n"
            " try:\n"
            f"  s=socket.create_connection(('{self.address(1)}',{port}),timeout=10);break\n"
            " except OSError: time.sleep(0.05)\n"
            f"s.sendall(b'x'*{nbytes});s.close()\n"
        )
        recv = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(1), "python3", "-c", receiver],
            stdout=subprocess.PIPE,
            text=True,
        )
        _run("ip", "netns", "exec", self.namespace(0), "python3", "-c", sender)
        out, _ = recv.communicate(timeout=120)
        received, seconds = out.split()
        return int(received) * 8 / float(seconds)

    def measure_collectives(
        self, ranks_per_node: int, message_mb: float = 4.0, repeats: int = 5
    ) -> dict:
        """`zppc links` run on the cluster (`--inter-link node`: the node's one
        link): the rates all-gathers inside and across the nodes get, what the
        cost model should price (data both ways at once gets less of this
        link than `measure_link`'s one-way stream)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "links.json"
            script = ["-m", "zppc", "links", "--inter-link=node", f"--node-size={ranks_per_node}"]
            script += [f"--message-mb={message_mb}", f"--repeats={repeats}", f"--output={out}"]
            self.launch(ranks_per_node, script, env={"PYTHONUNBUFFERED": "1"}, timeout=600)
            return json.loads(out.read_text())

    def launch(
        self, ranks_per_node: int, script: list[str], env: dict[str, str], timeout: float
    ) -> list[str]:
        """Run `torchrun --nnodes K` in every node; return each node's output."""
        port = "29511"  # the namespaces are fresh: nothing else listens there
        env = {**env, **self.cpu_shares(self.nodes * ranks_per_node)}
        procs = []
        for node in range(self.nodes):
            cmd = [
                *self.exec_args(node, env),
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={self.nodes}",
                f"--node-rank={node}",
                f"--nproc-per-node={ranks_per_node}",
                f"--master-addr={self.address(0)}",
                f"--master-port={port}",
                *script,
            ]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        outputs = [""] * len(procs)

        def drain(i: int) -> None:
            outputs[i] = procs[i].communicate()[0]

        threads = [
            threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            for p in procs:
                p.kill()
            raise ClusterError(f"the job did not finish within {timeout:.0f}s")
        failed = [i for i, p in enumerate(procs) if p.returncode]
        if failed:
            # The whole output of every node, for what the error's tail cuts off.
            logs = Path(tempfile.mkdtemp(prefix="zppc-cluster-failure-"))
            for i, output in enumerate(outputs):
                (logs / f"node{i}.log").write_text(output)
            raise ClusterError(
                f"node {failed[0]} failed (every node's output in {logs}):\n"
                f"{outputs[failed[0]][-4000:]}"
            )
        return outputs


def cpu_per_rank_arg(value: str) -> float | str:
    """`--cpu-per-rank`'s value: a positive share of a core, or "auto"."""
    if value == "auto":
        return value
    try:
        share = float(value)
    except ValueError:
        share = 0.0
    if share <= 0:
        raise argparse.ArgumentTypeError(f"a positive share of a core or auto, got {value!r}")
    return share


def resolve_cpu_per_rank(share: float | str | None, world: int) -> float | None:
    """ "auto" as the host's cores shared evenly among `world` ranks."""
    return os.cpu_count() / world if share == "auto" else share


def _own_cpu_group() -> Path | None:
    """This rank's cgroup, where the cluster made one (`cpu_shares`)."""
    root = os.environ.get(CPU_SHARE_ENV)
    return Path(root, f"r{os.environ['RANK']}") if root else None


def join_cpu_share() -> None:
    """Move this rank's process (every thread) into its cgroup, where the
    cluster made one (`EmulatedCluster.cpu_per_rank`); a rank calls it first."""
    group = _own_cpu_group()
    if group is not None:
        (group / "cgroup.procs").write_text(str(os.getpid()))


def cpu_share() -> float | None:
    """The share of a core this rank is held to (None: no `cpu_per_rank`)."""
    group = _own_cpu_group()
    if group is None:
        return None
    quota = int((group / "cpu.cfs_quota_us").read_text())
    return quota / int((group / "cpu.cfs_period_us").read_text())

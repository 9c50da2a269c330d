"""Where the two benchmark processes run: plain loopback, or two network
namespaces joined by a veth pair shaped with ``tc tbf`` (``netns:10gbit``),
which reproduces a two-machine link on one box. Namespaces, veths and qdiscs
are removed on exit, also after Ctrl-C or an error."""
from __future__ import annotations

import os
import shutil
import subprocess


class LinkError(RuntimeError):
    pass


class Loopback:
    name = "loopback"
    send_host = recv_host = "127.0.0.1"

    def wrap(self, side: str, cmd: list[str]) -> list[str]:
        return cmd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Netns:
    def __init__(self, rate: str = "10gbit"):
        if os.geteuid() != 0:
            raise LinkError("--link netns needs root (ip netns, tc); run as root or use --link loopback")
        if not shutil.which("ip") or not shutil.which("tc"):
            raise LinkError("--link netns needs the ip and tc commands (iproute2)")
        tag = f"{os.getpid() % 100000}"
        self.rate = rate
        self.name = f"netns:{rate}"
        self.ns = {"send": f"pdsend{tag}", "recv": f"pdrecv{tag}"}
        self.dev = {"send": f"pdvs{tag}", "recv": f"pdvr{tag}"}
        octet = 1 + os.getpid() % 250
        self.addr = {"send": f"10.231.{octet}.1", "recv": f"10.231.{octet}.2"}
        self.send_host, self.recv_host = self.addr["send"], self.addr["recv"]

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def __enter__(self):
        try:
            for side in ("send", "recv"):
                self._ip("netns", "add", self.ns[side])
            self._ip("link", "add", self.dev["send"], "type", "veth", "peer", "name", self.dev["recv"])
            for side in ("send", "recv"):
                ns, dev = self.ns[side], self.dev[side]
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{self.addr[side]}/30", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                self.rate, "burst", "4mb", "latency", "20ms"], check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise LinkError(f"setting up the link failed: {e.stderr.decode().strip() or e}") from None
        return self

    def wrap(self, side: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *cmd]

    def __exit__(self, *exc):
        for side in ("send", "recv"):
            subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True)
        return False


class RemoteHost:
    """One network namespace joined to this one by a veth pair, shaped with ``tc tbf`` both ways: a second host
    for a test or benchmark (``wrap`` runs a command on it, ``address`` is its side, ``local`` this side).
    ``cut`` takes the link down (no reset reaches either end: packets just stop), ``restore`` brings it back."""

    def __init__(self, rate: str = "1gbit", tag: str | None = None):
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise LinkError("a namespace host needs root and the ip and tc commands (iproute2)")
        tag = tag or f"{os.getpid() % 100000}"
        self.rate, self.ns, self.dev, self.peer_dev = rate, f"pdhost{tag}", f"pdh{tag}", f"pdhp{tag}"
        octet = 1 + os.getpid() % 250
        self.local, self.address = f"10.232.{octet}.1", f"10.232.{octet}.2"

    def _run(self, *cmd):
        subprocess.run(cmd, check=True, capture_output=True)

    def _shape(self, prefix: list[str], dev: str):
        self._run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "64kb",
                  "latency", "200ms")

    def __enter__(self):
        try:
            self._run("ip", "netns", "add", self.ns)
            self._run("ip", "link", "add", self.dev, "type", "veth", "peer", "name", self.peer_dev)
            self._run("ip", "link", "set", self.peer_dev, "netns", self.ns)
            self._run("ip", "addr", "add", f"{self.local}/30", "dev", self.dev)
            self._run("ip", "link", "set", self.dev, "up")
            inside = ["ip", "netns", "exec", self.ns]
            self._run(*inside, "ip", "addr", "add", f"{self.address}/30", "dev", self.peer_dev)
            self._run(*inside, "ip", "link", "set", self.peer_dev, "up")
            self._run(*inside, "ip", "link", "set", "lo", "up")
            self._shape([], self.dev)
            self._shape(inside, self.peer_dev)
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise LinkError(f"setting up the namespace host failed: {e.stderr.decode().strip() or e}") from None
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def cut(self):
        self._run("ip", "link", "set", self.dev, "down")

    def restore(self):
        self._run("ip", "link", "set", self.dev, "up")

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True)
        return False


def make_link(spec: str):
    if spec == "loopback":
        return Loopback()
    if spec.startswith("netns"):
        _, _, rate = spec.partition(":")
        return Netns(rate or "10gbit")
    raise LinkError(f"unknown link {spec!r}: loopback or netns[:RATE]")

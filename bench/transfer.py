"""``pdserve bench transfer``: move one KV payload between two real processes
with each chosen transport and with the plain-socket reference, repetitions
interleaved (iperf3, socket, A, B, iperf3, socket, A, B ...), warm-up excluded,
on loopback or across two network namespaces (``bench.link``). The receiving
process materializes each transfer (deserialize + h2d) and reports its phases
and when it finished: the monotonic time the receiver marked the transfer
complete plus the time materializing took (the wake-up of the thread that
waits is left out: it belongs to the consumer, not the transport). From the
sender's start time that gives an independent wall clock the phases are
checked against."""
from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time

from .payload import PRESETS, as_fp8, layout_from_args
from .report import command_line, write_reports
from planner.stats import summary

log = logging.getLogger(__name__)

IPERF, SOCKET = "iperf3", "socket"


def add_arguments(p):
    p.add_argument("--preset", default="mistral-7b@871", help=f"one of {sorted(PRESETS)}")
    p.add_argument("--layers", type=int, default=0, help="custom shape instead of a preset")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=871)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--transports", default="tcp", help="comma-separated transport names")
    p.add_argument("--against-fp8", action="store_true", help="also move the same KV as an FP8 cache holds it "
                   "(e4m3, half the bytes) in the same run, over the same link, and report the speed-up per phase")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--link", default="loopback", help="loopback | netns[:RATE] (two namespaces, veth shaped by tc tbf)")
    p.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                   help="transport option for both peers (repeatable), e.g. arrow_streams=1")
    p.add_argument("--out", default="bench/out/transfer", help="report path prefix (.json/.md/.png)")


_TOKEN_ENV = {} if os.environ.get("PDSERVE_CLUSTER_TOKEN") else {"PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32)}


# on a tbf-shaped link, pause before every measured transfer so each starts with a full token bucket
SETTLE_S = 0.02


def _start(link, side: str, args: list[str]) -> subprocess.Popen:
    cmd = link.wrap(side, [sys.executable, "-m", "bench.peers", *args])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **_TOKEN_ENV})


def _ask(proc: subprocess.Popen, msg: dict) -> dict:
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    return _read(proc)


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"benchmark peer exited (code {proc.wait()})")
    return json.loads(line)


def measure(names, layout, reps, warmup, link):
    hostfile, reserved = "", []
    if "mlx" in names:  # the ring's ports: held here on loopback (control.listen.reserve); fixed in the namespaces
        import tempfile

        from control.listen import port_of, reserve

        if link.name == "loopback":
            reserved = [reserve(link.send_host), reserve(link.recv_host)]
        ports = [port_of(sock) for sock in reserved] or [47001, 47002]
        fd, hostfile = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"{link.send_host}:{ports[0]}"], [f"{link.recv_host}:{ports[1]}"]], f)
    rx = _start(link, "recv", ["recv", link.recv_host, ",".join(names), str(layout.total_nbytes), hostfile])
    tx = _start(link, "send", ["send", ",".join(names), json.dumps(layout.to_dict()), hostfile])
    iperf = Iperf(link, layout.total_nbytes) if shutil.which("iperf3") else None
    try:
        addresses = _read(rx)["addresses"]
        _read(tx)
        samples = {n: [] for n in ([IPERF] if iperf else []) + [SOCKET, *names]}
        settle = SETTLE_S if link.name.startswith("netns") else 0.0
        for rep in range(warmup + reps):
            keep = rep >= warmup
            if iperf:
                ms = iperf.run()
                if keep:
                    samples[IPERF].append({"wall": ms})
            time.sleep(settle)
            wall = _ask(tx, {"name": "reference", "dest": addresses["reference"]})["wall"]
            if keep:
                samples[SOCKET].append({"wall": wall})
            for n in names:
                time.sleep(settle)
                tid = f"{n}-{rep}"
                rx.stdin.write(json.dumps({"name": n, "tid": tid}) + "\n")
                rx.stdin.flush()
                start = _ask(tx, {"name": n, "tid": tid, "dest": addresses[n]})["start"]
                got = _read(rx)
                if keep:
                    samples[n].append({**got["phases"], "wall": (got["done"] - start) * 1e3})
        return samples
    finally:
        for proc in (tx, rx):
            proc.stdin.close()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if iperf:
            iperf.close()
        for sock in reserved:
            sock.close()


class Iperf:
    """iperf3 moving the same number of bytes over the same link, one run per repetition."""

    def __init__(self, link, nbytes: int):
        """iperf3 must be told its port and cannot report one: on loopback a port free now, and another (logged) if
        the server exits because something took it first; 5201 in a namespace the benchmark made."""
        import socket

        self.link, self.nbytes = link, nbytes
        for attempt in range(5):
            if link.name == "loopback":
                with socket.socket() as s:
                    s.bind((link.recv_host, 0))
                    self.port = s.getsockname()[1]
            else:
                self.port = 5201
            self.server = subprocess.Popen(link.wrap("recv", ["iperf3", "-s", "-B", link.recv_host, "-p",
                                                              str(self.port)]),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            if self.server.poll() is None:
                return
            log.warning("iperf3 could not listen on port %d (taken?); trying another (%d of 5)", self.port, attempt + 1)
        raise RuntimeError("iperf3 did not start its server")

    def run(self) -> float:
        cmd = self.link.wrap("send", ["iperf3", "-c", self.link.recv_host, "-p", str(self.port), "-n", str(self.nbytes), "-J"])
        for _ in range(5):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                end = json.loads(out.stdout)["end"]
                bps = end["sum_received"]["bits_per_second"] or end["sum_sent"]["bits_per_second"]
                if bps > 0:
                    return self.nbytes * 8 / bps * 1e3
                raise RuntimeError(f"iperf3 measured nothing for {self.nbytes} bytes; use a larger payload")
            time.sleep(0.3)
        raise RuntimeError(f"iperf3 failed: {out.stdout[-300:]} {out.stderr[-300:]}")

    def close(self):
        self.server.terminate()
        self.server.wait(5)


def summarize(samples, nbytes):
    reference = IPERF if IPERF in samples else SOCKET
    ref_ms = summary(s["wall"] for s in samples[reference])["median"]
    out = {}
    for name, rows in samples.items():
        wall = summary(r["wall"] for r in rows)
        entry = {"wall_ms": wall, "gbps": nbytes * 8 / (wall["median"] * 1e6), "pct_of_reference": 100 * ref_ms / wall["median"]}
        if name not in (IPERF, SOCKET):
            for phase in ("d2h", "serialize", "wire", "deserialize", "h2d", "total"):
                entry[f"{phase}_ms"] = summary(r[phase] for r in rows)
            entry["phase_sum_vs_wall_pct"] = 100 * entry["total_ms"]["median"] / wall["median"]
            entry["ser_deser_pct_of_wire"] = 100 * (entry["serialize_ms"]["median"] + entry["deserialize_ms"]["median"]) / entry["wire_ms"]["median"]
        out[name] = entry
    return out


def fp8_speedup(base: dict, fp8: dict) -> dict:
    """Per transport: how many times faster the FP8 KV moved than the preset's, end to end and on the wire."""
    out = {}
    for name, entry in base.items():
        row = {"wall": entry["wall_ms"]["median"] / fp8[name]["wall_ms"]["median"]}
        if "wire_ms" in entry:
            row["wire"] = entry["wire_ms"]["median"] / fp8[name]["wire_ms"]["median"]
        out[name] = row
    return out


def environment() -> dict:
    import torch

    try:
        commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    except OSError:
        commit = ""
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "commit": commit}


def run(args) -> int:
    from .link import LinkError, make_link

    layout = layout_from_args(args)
    names = [n for n in args.transports.split(",") if n]
    print(f"payload {layout.total_nbytes / 1e6:.1f} MB ({args.preset if not args.layers else 'custom'}), "
          f"transports {names} vs iperf3/socket, link {args.link}, {args.reps} reps after {args.warmup} warm-up", flush=True)
    try:
        given = dict(o.split("=", 1) for o in args.kv_option)
    except ValueError:
        print("pdserve bench transfer: --kv-option takes KEY=VALUE", file=sys.stderr)
        return 2
    os.environ["PDSERVE_BENCH_KV_OPTIONS"] = json.dumps(given)
    ray_cluster = None
    if "ray" in names and not os.environ.get("RAY_ADDRESS"):
        from deploy.raycluster import RayCluster

        ray_cluster = RayCluster(num_cpus=2, token=os.environ.get("RAY_AUTH_TOKEN")).start()
        os.environ.update(ray_cluster.env)
    fp8 = None
    try:
        with make_link(args.link) as link:
            samples = measure(names, layout, args.reps, args.warmup, link)
            if args.against_fp8:
                fp8 = as_fp8(layout)
                fp8_samples = measure(names, fp8, args.reps, args.warmup, link)
    except LinkError as e:
        print(f"pdserve bench transfer: {e}", file=sys.stderr)
        return 2
    finally:
        if ray_cluster:
            ray_cluster.stop()
    report = {"command": command_line("transfer"), "layout": layout.to_dict(),
              "bytes": layout.total_nbytes, "link": args.link, "kv_options": given, "env": environment(),
              "summary": summarize(samples, layout.total_nbytes), "samples": samples}
    if fp8 is not None:
        report["fp8"] = {"layout": fp8.to_dict(), "bytes": fp8.total_nbytes, "samples": fp8_samples,
                         "summary": summarize(fp8_samples, fp8.total_nbytes)}
        report["fp8_speedup"] = fp8_speedup(report["summary"], report["fp8"]["summary"])
    paths = write_reports(report, args.out)
    print(paths["markdown_text"])
    print("wrote " + ", ".join(v for k, v in paths.items() if k != "markdown_text"))
    return 0

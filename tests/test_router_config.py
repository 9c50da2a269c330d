import os
import subprocess
import sys

import pytest

from router.config import RouterConfig
from router.policy import LeastOutstanding, RoundRobin


def test_toml_config_with_flag_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[router]\nport = 9000\nprefill = ["tcp://10.0.0.1:7001"]\ndecode = ["tcp://10.0.0.2:7101"]\n')
    cfg = RouterConfig.from_toml(str(path), port=9100, policy=None)
    assert cfg.port == 9100 and cfg.prefill == ["tcp://10.0.0.1:7001"] and cfg.policy == "least_outstanding"


@pytest.mark.parametrize("kwargs", [dict(prefill=["tcp://a:1"]), dict(prefill=["a:1"], decode=["tcp://b:2"]),
                                    dict(colocated=["tcp://a:1"], prefill=["tcp://b:2"], decode=["tcp://c:3"]),
                                    dict(colocated=["tcp://a:1"], policy="random")])
def test_invalid_configs(kwargs):
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


def test_unknown_toml_keys_rejected(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[router]\nprefil = ["tcp://a:1"]\n')
    with pytest.raises(ValueError, match="prefil"):
        RouterConfig.from_toml(str(path))


class W:
    def __init__(self, n):
        self.outstanding = n


def test_policies():
    ws = [W(3), W(1), W(1)]
    lo = LeastOutstanding()
    assert {id(lo.pick(ws)) for _ in range(4)} == {id(ws[1]), id(ws[2])}
    rr = RoundRobin()
    assert [rr.pick(ws) for _ in range(3)] == ws


def test_kv_options_reach_the_transport_and_up_forwards_them():
    import argparse

    from pdserve.cli import _parser, _transport_config, kv_option
    from deploy.up import engine_args

    assert kv_option("nccl_rank=1") == ("nccl_rank", 1) and kv_option("nixl_pool_bytes=64M") == ("nixl_pool_bytes", 64 << 20)
    assert kv_option("nixl_progress_thread=true") == ("nixl_progress_thread", True)
    assert kv_option("nccl_init=tcp://127.0.0.1:29500") == ("nccl_init", "tcp://127.0.0.1:29500")
    for bad in ("no-equals", "=1", "bad key=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            kv_option(bad)
    opts = ["--kv-option", "nccl_init=tcp://127.0.0.1:29500", "--kv-option", "nccl_rank=1",
            "--kv-option", "nixl_progress_thread=false"]
    args = _parser().parse_args(["decode", "--transport", "nccl", *opts])
    assert _transport_config(args).options == {"mlx_backend": "ring", "nccl_init": "tcp://127.0.0.1:29500",
                                               "nccl_rank": 1, "nixl_progress_thread": False}
    up = _parser().parse_args(["up", "--transport", "nixl", *opts])
    assert engine_args(up)[-6:] == opts


def test_the_router_never_imports_torch():
    import subprocess
    import sys
    code = "import sys, pdserve.cli, router.main, router.app; pdserve.cli._parser(with_bench=False); print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_usr1_writes_every_threads_stack_and_the_process_keeps_serving():
    """``kill -USR1`` on a pdserve process (here a router) prints its threads' stacks to stderr; it goes on serving."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import socket

    from control.listen import listen, port_of

    sock, absent = listen("127.0.0.1"), socket.socket()
    absent.bind(("127.0.0.1", 0))  # a colocated worker that is not there (bound, refusing): the router serves 503s
    port = port_of(sock)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "router", "--listen-fd",
                             str(sock.fileno()), "--colocated", f"tcp://127.0.0.1:{port_of(absent)}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, pass_fds=[sock.fileno()])
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError as e:
                if getattr(e, "code", None):  # an HTTP status (no workers yet): it is up
                    break
                time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "most recent call first" in err and "Thread 0x" in err


def test_up_removes_the_mlx_hostfile_it_made_when_it_exits():
    code = ("from pdserve.cli import _parser; from deploy.up import plan\n"
            "cmds = plan(_parser().parse_args(['up', '--transport', 'mlx']))\n"
            "print(cmds[0][cmds[0].index('--mlx-hostfile') + 1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = out.stdout.strip().splitlines()[-1]
    assert path.endswith(".json") and not os.path.exists(path)


def test_up_passes_the_disagg_settings_to_its_router():
    from pdserve.cli import _parser
    from deploy.up import plan

    router = plan(_parser().parse_args(["up", "--disagg", "auto", "--disagg-prefill-wait-ms", "80",
                                        "--disagg-prefill-queue", "6"]))[-1]
    assert router[router.index("--disagg-prefill-wait-ms") + 1] == "80.0"
    assert router[router.index("--disagg-prefill-queue") + 1] == "6"
    args = _parser().parse_args(router[3:])  # the router's own command line
    assert (args.disagg, args.disagg_prefill_wait_ms, args.disagg_prefill_queue) == ("auto", 80.0, 6)


def test_a_port_named_that_is_taken_is_one_line_and_exit_2():
    """``up``, the router and a worker: the port and its flag on one line, exit code 2, nothing started."""
    from control.listen import listen, port_of

    taken = listen("127.0.0.1")
    port = str(port_of(taken))
    cases = [["up", "--port", port], ["router", "--port", port, "--colocated", "tcp://127.0.0.1:9"],
             ["prefill", "--port", port], ["decode", "--kv-port", port, "--threads", "1"]]
    for argv in cases:
        out = subprocess.run([sys.executable, "-m", "pdserve", "--log-level", "ERROR", *argv], capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        flag = "--kv-port" if "--kv-port" in argv else "--port"
        assert out.returncode == 2, (argv, out.stderr[-2000:])
        assert out.stderr.strip().splitlines()[-1] == (f"pdserve: port {port} on 127.0.0.1 is in use ({flag}); name "
                                                        "another, or 0 for any free port"), (argv, out.stderr[-2000:])
    taken.close()

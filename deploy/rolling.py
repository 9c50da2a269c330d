"""``pdserve up``'s rolling restart (``kill -HUP`` its pid): one worker after another is drained through the router
(``router.drain``: out of the picks, its decoding requests moved to the others while they stream), stopped, started
again with the same command line (same ports: the router reconnects by itself) and put back in the picks once the
router has it healthy. The cluster serves throughout; no stream ends. A worker the router cannot drain (the last of
its role) is stopped through its own drain instead (SIGTERM: it finishes what it holds first), the requests sent
meanwhile wait for it (``--retry-wait``)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from .drain import drain, worker_state

log = logging.getLogger("pdserve.up")
DRAIN_WAIT_S = 120.0  # for a worker's requests to move or end
STOP_WAIT_S = 60.0


def address_of(cmd: list[str]) -> str | None:
    """``tcp://HOST:PORT`` of a worker's command line (None: not a worker's)."""
    try:
        return f"tcp://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
    except (ValueError, IndexError):
        return None


def restart_all(children: list, url: str, ready_s: float) -> None:
    """Each restartable, running worker of ``children`` (``supervise.Child``) in turn, those that decode first (their
    streams are what a restart must not end)."""
    key = os.environ.get("PDSERVE_API_KEY")
    for child in sorted([c for c in children if c.restartable and c.running], key=lambda c: "prefill" in c.name):
        address = address_of(child.cmd)
        if address is not None:
            restart_one(child, address, url, key, ready_s)


def restart_one(child, address: str, url: str, key: str | None, ready_s: float) -> None:
    status, answer = drain(url, address, key, wait_s=DRAIN_WAIT_S)
    drained = status == 200
    if not drained:
        log.warning("%s: the router did not drain it (%s: %s); it finishes its requests itself", child.name, status,
                    (answer.get("error") or {}).get("message", answer))
    child.proc.send_signal(signal.SIGTERM)
    try:
        child.proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait()
    child.restarts += 1
    child.start()
    log.warning("%s restarted for the rolling restart (pid %d)", child.name, child.proc.pid)
    end = time.monotonic() + ready_s
    while time.monotonic() < end and child.running and not worker_state(url, address, key).get("healthy"):
        time.sleep(0.3)
    if drained:
        drain(url, address, key, undo=True)

"""NIXL specifics: idle agents leave the CPU to the model."""
import os
import time

import pytest

pytest.importorskip("nixl")

from kvtransfer import TransportConfig, make_receiver, make_sender  # noqa: E402


@pytest.mark.serial
def test_idle_nixl_agents_do_not_spin():
    cfg = TransportConfig(options={"nixl_pool_bytes": 16 << 20})
    receiver, sender = make_receiver("nixl", cfg), make_sender("nixl", cfg)
    receiver.start()
    try:
        t0, w0 = os.times(), time.monotonic()
        time.sleep(1.5)
        t1 = os.times()
        busy = (t1.user - t0.user + t1.system - t0.system) / (time.monotonic() - w0)
        assert busy < 0.25, f"idle sender + receiver used {busy:.0%} of a core"
    finally:
        sender.close()
        receiver.close()

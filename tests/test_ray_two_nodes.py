"""The Ray transport between two Ray nodes: sender and receiver actors pinned to different nodes."""
import hashlib

import pytest

ray = pytest.importorskip("ray")


def digest(layers):
    import torch

    h = hashlib.sha256()
    for k, v in layers:
        for t in (k, v):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_transfer_between_two_ray_nodes(ray_cluster):
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvtransfer import TransportConfig, make_receiver, make_sender
    from kvtransfer.transports.ray_store import connect
    from kvtransfer.tensors import layout_of, materialize

    connect(TransportConfig())
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(nodes) == {"127.0.0.2", "127.0.0.3"}

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self):
            self.r = make_receiver("ray", TransportConfig(timeout_s=30))
            self.r.start()

        def address(self):
            return self.r.address, ray.get_runtime_context().get_node_id()

        def take(self, tid):
            got = self.r.wait(tid, 30)
            layers = materialize(got, "cpu")
            out = digest(layers), got.phases.to_dict()
            got.release()
            return out

    @ray.remote(num_cpus=0)
    class Sender:
        def send(self, dest, tid):
            gen = torch.Generator().manual_seed(5)
            kv = [tuple(torch.randn(8, 300, 64, generator=gen).to(torch.bfloat16) for _ in range(2)) for _ in range(6)]
            make_sender("ray").send(dest, tid, layout_of(kv), kv)
            return digest(kv), ray.get_runtime_context().get_node_id()

    def on(ip):
        return NodeAffinitySchedulingStrategy(nodes[ip], soft=False)

    receiver = Receiver.options(scheduling_strategy=on("127.0.0.3")).remote()
    sender = Sender.options(scheduling_strategy=on("127.0.0.2")).remote()
    address, receiver_node = ray.get(receiver.address.remote())
    sent, sender_node = ray.get(sender.send.remote(address, "two-node"))
    received, phases = ray.get(receiver.take.remote("two-node"))
    assert (sender_node, receiver_node) == (nodes["127.0.0.2"], nodes["127.0.0.3"])
    assert received == sent
    assert phases["bytes"] == 6 * 2 * 8 * 300 * 64 * 2 and phases["wire"] > 0

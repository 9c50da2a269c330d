"""Hidden states from one pipeline stage to the next over a kvtransfer transport (a hop).

A micro-batch's residual stream ``[tokens, hidden]`` goes as a one-layer KV
whose K is the first half of its bytes and V the second (``head_dim`` =
hidden / 2, one head), so every transport carries it unchanged, with its
phase timing (d2h, serialize, wire, deserialize, h2d). The transfer id is
the micro-batch's tag; ``meta`` carries the phases of the hops it took
before, so the last hop back to stage 0 delivers the whole journey's
timing with the hidden states."""
from __future__ import annotations

import torch

from kvtransfer.base import TransportConfig
from kvtransfer.layout import KVLayout
from kvtransfer.registry import make_receiver, make_sender
from kvtransfer.tensors import dtype_name, materialize


def hop_layout(x: torch.Tensor) -> KVLayout:
    tokens, hidden = x.shape
    return KVLayout(1, 1, hidden // 2, tokens, dtype_name(x.dtype))


class HopLink:
    """One stage's end of the pipeline: a receiver for what comes in, a sender for what goes out."""

    def __init__(self, transport: str, token: bytes | None, device: torch.device, timeout_s: float = 60.0,
                 host: str = "127.0.0.1"):
        options = {}
        if transport == "nccl":  # the stage's own GPU; on the CPU the same protocol over gloo
            options = {"device": str(device)} if device.type == "cuda" else {"nccl_backend": "gloo"}
        cfg = TransportConfig(host=host, token=token, timeout_s=timeout_s, pool_bytes=1 << 30, max_transfer_bytes=1 << 30,
                              options=options)
        self.device = device
        self.receiver = make_receiver(transport, cfg)
        self.receiver.start()
        self.sender = make_sender(transport, cfg)
        self.timeout_s = timeout_s

    @property
    def address(self) -> str:
        return self.receiver.address

    def send(self, dest: str, tag: str, x: torch.Tensor, hops: list) -> dict:
        """``x`` (``[tokens, hidden]``) to the stage at ``dest``; ``hops``: the phases of the hops before.
        Returns this hop's phases."""
        if x.is_cuda:  # the stage's kernels end first, so d2h is the copy alone (not this stage's compute)
            torch.cuda.current_stream(x.device).synchronize()
        flat = x.detach().contiguous().view(-1)
        half = flat.numel() // 2
        layout = hop_layout(x)
        k, v = flat[:half].view(layout.tensor_shape), flat[half:].view(layout.tensor_shape)
        return self.sender.send(dest, tag, layout, [(k, v)], {"hops": hops}).to_dict()

    def recv(self, tag: str, timeout_s: float | None = None) -> tuple[torch.Tensor, list]:
        """The hidden states tagged ``tag`` on this stage's device, and the phases of every hop they took (the
        last is the hop just received, as the receiver measured it)."""
        received = self.receiver.wait(tag, self.timeout_s if timeout_s is None else timeout_s)
        try:
            (k, v), = materialize(received, self.device)
            layout = received.layout
            with received.phases.measure("deserialize"):
                x = torch.cat([k.reshape(-1), v.reshape(-1)]).view(layout.num_tokens, 2 * layout.head_dim)
            hops = list((received.meta or {}).get("hops") or []) + [received.phases.to_dict()]
        finally:
            received.release()
        return x, hops

    def abort(self, tag: str) -> None:
        self.receiver.abort(tag)

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            try:
                end.close()
            except Exception:  # noqa: BLE001 (closing: nothing left to report to)
                pass

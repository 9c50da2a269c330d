"""Rank 0 of a two-rank MLX world for tests: runs MlxSender.send for each connection it accepts."""
import os
import signal
import threading
from multiprocessing.connection import Listener

import torch

from kvtransfer import KVLayout, TransportConfig, make_sender
from kvtransfer.tensors import TORCH_DTYPES, to_mlx
from tests.transports import send_placed


def serve(sender, conn):
    with conn:
        dest, tid, layout_dict, blobs, die_after, placed, as_mlx = conn.recv()
        layout = KVLayout.from_dict(layout_dict)
        dtype = TORCH_DTYPES[layout.dtype]

        def layers():
            for i, (k, v) in enumerate(blobs):
                if i == die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                pair = tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).view(layout.tensor_shape)
                             for b in (k, v))
                yield tuple(to_mlx(t) for t in pair) if as_mlx else pair
        try:
            if placed:
                conn.send(send_placed(sender, dest, tid, list(layers())))
                return
            sender.send(dest, tid, layout, layers())
            conn.send(None)
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")


def main():
    listener = Listener(("127.0.0.1", 0), backlog=64, authkey=bytes.fromhex(os.environ["PDSERVE_TEST_KEY"]))
    print(listener.address[1], flush=True)
    sender = make_sender("mlx", TransportConfig(timeout_s=20))
    while True:
        conn = listener.accept()
        threading.Thread(target=serve, args=(sender, conn), daemon=True).start()


if __name__ == "__main__":
    main()

"""A sender process that dies (SIGKILL) in the middle of a transfer."""
import os
import signal
import sys

import torch

from kvtransfer import KVLayout, TransportConfig, make_sender


def main(name, dest, tid):
    layout = KVLayout(16, 4, 128, 256, "float16")
    sender = make_sender(name, TransportConfig(timeout_s=10, options={"nixl_pool_bytes": 64 << 20}))

    def layers():
        for i in range(layout.num_layers):
            if i == 8:
                os.kill(os.getpid(), signal.SIGKILL)
            yield torch.ones(layout.tensor_shape, dtype=torch.float16), torch.ones(layout.tensor_shape, dtype=torch.float16)
    sender.send(dest, tid, layout, layers())


if __name__ == "__main__":
    main(*sys.argv[1:])

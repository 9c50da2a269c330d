"""The nccl transport: KV from GPU to GPU over NCCL point-to-point (``transport``: the sender and receiver and their
protocol), the two-rank process groups its ends form (``pairs``), the posted operations and the gathers and
scatters around them (``ops``), cancelling a push without losing its pair (``cancels``), and the CUDA IPC copy for
a sender and receiver on one GPU, which NCCL cannot pair (``same_gpu``)."""

"""Tensor parallelism: one model split over ``tp`` processes (ranks), one device each.

Protocol. The worker process is rank 0: it owns the scheduler, the block
manager and the control connection to the router, exactly as with one
device. It starts ranks 1..tp-1 as child processes (``launch``), which join a
``torch.distributed`` group with it (NCCL on CUDA, gloo on the CPU) and then
follow its step plan (``plan``): before every forward, rank 0 sends each
follower the step's rows (new token ids, start position, block table, what
to sample) and any block copies, as one small msgpack message on a zmq
socket; every rank runs the same forward on its shard, meeting the others in
the all-reduces of the row-parallel layers, so no rank schedules on its own
and none can drift. Rank 0 samples; the next step's plan carries the
tokens. KV transfers are planned the same way: each rank moves its own head
slice (``kvtransfer`` never sees more than one rank's KV).

Sharding (``heads``, ``layers``): q/k/v and gate/up are column-parallel (each
rank computes its heads / its slice of the MLP, fused per rank), o and down
row-parallel (an all-reduce of the partial sums), the embedding and lm_head
vocab-parallel. Each rank's KV pool holds its KV heads; when the model has
fewer KV heads than ranks each head is replicated on the ranks whose query
heads read it. A rank that dies takes its group down (``launch``): the
worker fails its requests and exits, and is restarted as a unit."""

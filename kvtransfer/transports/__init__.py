"""The transports: each moves a KV from a sender to a receiver its own way, behind ``base``'s interface and
``registry``'s names. One module each (``tcp``, ``shm``, ``pickle_tcp``, ``mlx_dist``, ``nixl_ucx``,
``ray_store``), a folder where one grew several parts (``arrow``: Flight sender, receiver, the wire schema;
``nccl``: protocol, pairs, posted operations, the same-GPU copy). The framing, layout, pools and pieces they share
stay one level up, in ``kvtransfer``."""

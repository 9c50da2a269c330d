"""Experiments that settled a question once (their findings, with the commands that ran them, are in
bench/RESULTS.md): kept runnable (``python -m bench.lab.NAME``), not part of ``pdserve bench``.

- ``attention_choice``: which decode attention a step of unequal contexts should take;
- ``engine_waves``: the engine under waves of requests, step caps against none;
- ``pool_rows``: copying KV rows out of the pool by index, against per-block copies;
- ``prefix_ab``: multi-turn chats with prefix caching and KV-aware routing, against without;
- ``allreduce``: NCCL against the one-shot all-reduces at TP sizes, inside CUDA graphs."""

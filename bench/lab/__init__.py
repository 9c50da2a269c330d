"""Experiments that settled a question once (their findings, with the commands that ran them, are in
bench/RESULTS.md): kept runnable (``python -m bench.lab.NAME``), not part of ``pdserve bench``.

- ``attention_choice``: which decode attention a step of unequal contexts should take;
- ``engine_waves``: the engine under waves of requests, step caps against none;
- ``pool_rows``: copying KV rows out of the pool by index, against per-block copies;
- ``prefix_ab``: multi-turn chats with prefix caching and KV-aware routing, against without;
- ``allreduce``: NCCL against the one-shot all-reduces at TP sizes, inside CUDA graphs;
- ``prefix_attention``: a prompt chunk after a cached prefix, by attention kernel, and long prompts by step budget;
- ``trace_engine``: the engine alone on a trace window, where its time goes by kind of step;
- ``tier_copy``: the host KV tier's copy rates against pinned memory, a prefix from host memory against computing;
- ``kv_store``: the Ray object store against Mooncake Store as a cluster-wide pool of KV blocks."""

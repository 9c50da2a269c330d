"""``pdserve plan``: DistServe-style placement from measured profiles.

``profile`` (an engine's prefill and decode times on this hardware, from
``pdserve bench engine --profile``), ``simulate`` (a step-by-step simulation
of colocated replicas and prefill/decode splits), ``search`` (every
configuration of the GPUs, ranked by predicted goodput under the SLOs),
``cli`` (the command; ``--validate`` measures the best ones)."""

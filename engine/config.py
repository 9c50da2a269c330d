from __future__ import annotations

import os
from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda", "mps")
DECODE_GRAPHS = ("auto", "off", "eager", "cuda")
ENGINES = ("auto", "torch", "mlx")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 with per-layer scales (quant.kv_fp8)
QUANTIZATIONS = (None, "fp8")  # fp8: FP8 weights, per-output-channel scales (quant.fp8_linear; CUDA)
TINY = "tiny-llama"


@dataclass
class EngineConfig:
    model: str = TINY
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    threads: int | None = None
    served_name: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int | None = None
    kv_budget_bytes: int = 0
    kv_host_bytes: int = 0  # a host-memory tier under the pool's prefix cache (kvcache.HostTier); 0: none
    kv_disk: str | None = None  # a directory for a disk tier under the host tier (kvcache.DiskTier)
    kv_disk_bytes: int = 0
    kv_pool: str | None = None  # a cluster-wide KV pool on this store (kvcache.stores: mooncake://HOST:PORT)
    kv_pool_bytes: int = 0  # its size (this host's segment), which bounds what is remembered of it
    num_blocks: int | None = None
    prefix_caching: bool = True
    engine: str = "torch"  # torch | mlx | auto (mlx on macOS when mlx-lm is installed)
    decode_graphs: str = "auto"  # auto: CUDA graphs + Triton kernels on CUDA, off elsewhere; off; eager (tests)
    tp: int = 1  # tensor-parallel ranks (processes, one device each); see engine.parallel
    pp: int = 1  # pipeline stages (processes, each with a contiguous range of layers); see engine.pipeline
    pp_layers: str | None = None  # layers per stage, e.g. "10,22" (default: as even as can be)
    pp_transport: str = "tcp"  # the kvtransfer transport that carries hidden states between stages
    pp_placement_group: str | None = None  # a Ray placement group: stage k runs in its bundle k (engine.pipeline.ray_stages)
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights made on the device at load
    overlap: bool = True  # launch the next decode step before reading this one's tokens (engine.overlap)
    warmup: bool = True  # workers run engine.warmup before they serve
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    step_prefill_tokens: int | None = None  # prompt tokens a step that also decodes takes at most (step_budget)
    slo_tpot_ms: float | None = None  # or: learn that cap to keep such steps within this time

    @classmethod
    def from_options(cls, args) -> "EngineConfig":
        """From a worker's parsed command line: every option named as a field (``--kv-budget`` is
        ``kv_budget_bytes``), the rest at their defaults."""
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in vars(args).items() if k in names}
        return cls(**given, kv_budget_bytes=getattr(args, "kv_budget", 0) or 0)

    @property
    def tokenizer_source(self) -> str:
        """What the router loads to tokenize as this engine does: ``builtin``, or the checkpoint directory."""
        if self.model == TINY or (self.load_format == "dummy" and not os.path.isdir(self.model)):
            return "builtin"
        return os.path.abspath(self.model)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device {self.device!r} not in {DEVICES} (an index like cuda:1 is fine)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        for name in ("block_size", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) is None and name == "max_batched_tokens":
                continue
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer")
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r} not in {ENGINES}")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ValueError(f"decode_graphs {self.decode_graphs!r} not in {DECODE_GRAPHS}")
        if type(self.kv_host_bytes) is not int or self.kv_host_bytes < 0:
            raise ValueError("kv_host_bytes must be a size in bytes (0: no host tier)")
        if type(self.kv_disk_bytes) is not int or self.kv_disk_bytes < 0 or bool(self.kv_disk) != bool(self.kv_disk_bytes):
            raise ValueError("--kv-disk DIR and --kv-disk-bytes SIZE go together (and need --kv-host-bytes)")
        if self.kv_host_bytes and not self.prefix_caching:
            raise ValueError("--kv-host-bytes needs the prefix cache on")
        if (self.kv_disk or self.kv_pool) and (self.tp > 1 or self.pp > 1):
            raise ValueError("--kv-disk and --kv-pool work without --tp/--pp for now (--kv-host-bytes works with them)")
        if type(self.tp) is not int or self.tp < 1:
            raise ValueError("tp must be a positive integer")
        if type(self.pp) is not int or self.pp < 1:
            raise ValueError("pp must be a positive integer")
        if self.pp > 1 and self.tp > 1:
            raise ValueError("--pp and --tp together are not supported yet: give one of them")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} not in {LOAD_FORMATS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} not in {QUANTIZATIONS[1:]} (or none)")
        if self.step_prefill_tokens is not None and (type(self.step_prefill_tokens) is not int
                                                     or self.step_prefill_tokens < 1):
            raise ValueError("step_prefill_tokens must be a positive integer")
        if self.slo_tpot_ms is not None and not self.slo_tpot_ms > 0:
            raise ValueError("slo_tpot_ms must be positive")
        if self.kv_budget_bytes < 0 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("kv_budget_bytes must be >= 0 and num_blocks positive")

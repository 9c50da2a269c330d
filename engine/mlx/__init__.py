"""The MLX engine (``--engine mlx``, Apple silicon or mlx[cpu]): mlx-lm's models behind the torch engine's step
interface (``engine``), sequences split into micro-batches with caches of their own (``batches``), and loading
the built-in model or a local checkpoint through mlx-lm (``loader``). Its tensor- and pipeline-parallel groups
live with the torch engine's, in ``engine.parallel`` and ``engine.pipeline``."""

"""CUDA graphs of the engine's steps: decode steps at fixed batch sizes (``decode``), a lone prompt chunk padded to
a token bucket (``prompt``), and the device time of each decode replay read from CUDA events once complete
(``replay_timer``). Which of them an engine gets is ``engine.decode_path``'s choice."""

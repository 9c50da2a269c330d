"""Pipeline parallelism: a model's layers split into ``pp`` contiguous ranges (stages), one process each (the torch
engine's, below; the mlx engine's stages are ranks of its mx.distributed group: ``mlx_stages``).

Protocol. The worker process is stage 0 (``driver.Pipeline``): it owns the
scheduler, the block manager, the router connection, the embedding, the
final norm and the LM head, and samples. It starts stages 1..pp-1
(``launch.Stages``: ``python -m engine.pipeline.stage``); each loads only its
layers (``split.stage_spans``; the model's other layers are empty modules),
opens a hop receiver and says ``hello`` on the report socket with its model
and span; stage 0 refuses a stage that disagrees, takes the smallest block
count of all and sends each stage ``setup{blocks, next}`` (the next stage's
hop address; the last stage's next is stage 0), so one block table serves
every stage's pool.

Every step is a micro-batch: stage 0 sends ``step{rows, copies, tag}`` on the
step plan (``parallel.plan``, zmq + msgpack, in order per stage), runs the
embedding and its layers, and sends the residual stream of the rows to stage
1 over a kvtransfer transport (``hops``: a one-layer KV tagged with the
micro-batch, with every earlier hop's phases in its meta). Each stage takes
the next plan message, waits for that tag's hidden states, runs its layers
and sends them on. Stage 0 keeps up to ``pp`` micro-batches in flight and
lands the oldest when full: final norm, LM head, sampling. KV moves by layer
range: ``kv_push``/``kv_cancel`` ask a prefill worker's stage to send its
layers of a prompt's KV to the decode stages holding them
(``prefill.tp_kv``); ``kv_adopt``/``kv_abort`` have a decode worker's stage
place the layers it received itself (``decode.tp_kv``; it reports back);
``kv_relay{table, tag}`` gives it its layers of a KV that came whole to
stage 0 over its hop link. ``stop`` ends it.
A stage dies with stage 0; stage 0's worker exits when a stage dies, so its
supervisor restarts the pipeline as a unit."""

"""Correctness of the engine on a CUDA device (run on a GPU machine; CI runs the CPU path).

    python -m bench.gpu_check [--checkpoint DIR] [--out FILE.json]

* tiny model, fp32: greedy tokens of 8 prompts batched on CUDA equal those on the CPU;
* a checkpoint (e.g. ``bench.random_checkpoint --shape mistral-7b``) in its dtype: the scores of the first 32
  prompt positions from the engine against Hugging Face transformers' on the same device, max abs diff reported,
  and the greedy tokens of both for 16 steps; both against HF in fp32 (``fp32_reference``): the engine's rounding
  error next to HF's own in the same dtype (what "within bf16 tolerance" means here)."""
from __future__ import annotations

import argparse
import json

PROMPTS = ["Hello", "The capital of France is", "x" * 300, "a b c d e f g", "Once upon a time", "0123456789" * 20,
           "Ünïcödé ✓", "The quick brown fox jumps over the lazy dog. " * 8]


def scores_of(engine, ids):
    from engine import SamplingParams
    from engine.model_runner import step_rows
    from engine.scheduler import Batch
    from engine.sequence import Sequence

    seq = Sequence.create("check", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                          engine.tokenizer, engine.max_len)
    engine.blocks.grow(seq.block_table, len(ids))
    batch = Batch()
    batch.add(seq, len(ids))
    try:
        _, prompt_scores = engine.runner.run(step_rows(batch))
    finally:
        engine.blocks.release(seq.block_table)
    return prompt_scores[0]


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp32-layers", type=int, default=0,
                    help="also compare against HF in fp32 on a random Mistral-7B-wide checkpoint of this many layers")
    args = ap.parse_args(argv)
    report = {}
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for device, graphs in (("cpu", "off"), ("cuda", "auto"), ("cuda", "off")):
        engine = Engine(EngineConfig(device=device, dtype="float32", max_num_seqs=16, decode_graphs=graphs))
        results[(device, graphs)] = [s.output_ids for _, s in generate_many(engine, PROMPTS, [greedy] * len(PROMPTS))]
        if graphs == "auto":
            report["tiny_cuda_graph_replays"] = engine.runner.graphs.replays if engine.runner.graphs else 0
    report["tiny_fp32_cuda_equals_cpu"] = results[("cpu", "off")] == results[("cuda", "auto")]
    report["tiny_fp32_cuda_without_graphs_equals_cpu"] = results[("cpu", "off")] == results[("cuda", "off")]
    print("tiny fp32, 8 prompts batched: CUDA tokens == CPU tokens:", report["tiny_fp32_cuda_equals_cpu"],
          "(CUDA graphs, replays:", report["tiny_cuda_graph_replays"], "; without graphs:",
          report["tiny_fp32_cuda_without_graphs_equals_cpu"], ")", flush=True)
    if args.checkpoint:
        engine = Engine(EngineConfig(model=args.checkpoint, device="cuda", max_num_seqs=8, kv_budget_bytes=8 << 30))
        hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=engine.dtype).to(engine.device).eval()
        ids = [3 + (i * 7919) % 250 for i in range(32)]
        ours = scores_of(engine, ids)
        with torch.inference_mode():
            theirs = hf(input_ids=torch.tensor([ids], device=engine.device)).logits[0].float()
        diff = (ours - theirs).abs()
        report["checkpoint"] = args.checkpoint
        report["dtype"] = str(engine.dtype)
        report["max_abs_diff_first_32_logits"] = float(diff.max())
        report["logit_scale"] = float(theirs.abs().max())
        report["argmax_agree"] = int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        _, seq = generate_many(engine, [ids], [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)])[0]
        hf_ids, cur = [], torch.tensor([ids], device=engine.device)
        with torch.inference_mode():
            for _ in range(16):
                nxt = int(hf(input_ids=cur).logits[0, -1].argmax())
                hf_ids.append(nxt)
                cur = torch.cat([cur, torch.tensor([[nxt]], device=engine.device)], dim=1)
        report["greedy_16_equal"] = seq.output_ids == hf_ids
        report["greedy_16_common_prefix"] = next((i for i, (a, b) in enumerate(zip(seq.output_ids, hf_ids)) if a != b), 16)
        del hf
        torch.cuda.empty_cache()
        exact = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).to(engine.device).eval()
        with torch.inference_mode():
            ref = exact(input_ids=torch.tensor([ids], device=engine.device)).logits[0].float()
        del exact
        report["fp32_reference"] = {"engine_max_abs_diff": float((ours - ref).abs().max()),
                                    "hf_same_dtype_max_abs_diff": float((theirs - ref).abs().max()),
                                    "engine_argmax_agree": int((ours.argmax(-1) == ref.argmax(-1)).sum()),
                                    "hf_same_dtype_argmax_agree": int((theirs.argmax(-1) == ref.argmax(-1)).sum())}
        print(json.dumps({k: v for k, v in report.items()}, indent=1), flush=True)
    if args.fp32_layers:
        import tempfile

        from bench.random_checkpoint import main as write

        path = tempfile.mkdtemp(prefix="pdserve-fp32-")
        write(["--shape", "mistral-7b", "--out", path, "--dtype", "float32", "--layers", str(args.fp32_layers)])
        engine = Engine(EngineConfig(model=path, device="cuda", max_num_seqs=8, kv_budget_bytes=4 << 30))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device).eval()
        ids = [3 + (i * 7919) % 250 for i in range(32)]
        ours = scores_of(engine, ids)
        with torch.inference_mode():
            theirs = hf(input_ids=torch.tensor([ids], device=engine.device)).logits[0].float()
        report["fp32_layers"] = args.fp32_layers
        report["fp32_max_abs_diff_first_32_logits"] = float((ours - theirs).abs().max())
        report["fp32_argmax_agree"] = int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        print({k: v for k, v in report.items() if k.startswith("fp32")}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

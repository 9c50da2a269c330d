"""KV handed between tensor-parallel groups of different sizes on a 2-GPU machine, checked end to end.

    python -m bench.tp_handoff --out bench/results/tp-handoff-2xh200

* tiny fp32: ``pdserve up`` with prefill TP=2 on both GPUs and decode TP=1 sharing GPU 1, and the reverse (decode
  TP=2, prefill TP=1 sharing GPU 0), over nccl and tcp: greedy tokens of four prompts against the in-process
  engine on the CPU (fp32: equal token for token);
* Mistral-7B shape, bf16, ``--load-format dummy`` (the same weights at any TP): prefill TP=2 -> decode TP=1 (over
  the last of ``--transports``) and colocated TP=2 against colocated TP=1 on one GPU: how many greedy tokens agree
  and the largest logprob gap while they do; TP=2's gap is the bf16 noise the handoff's is judged by;
* ``--skip tiny,mistral`` on 8 GPUs (``llama8``, issue 32's run 4): Llama-3-70B shape, prefill TP=4 -> two decode
  groups of TP=2 and two prefill groups of TP=2 -> decode TP=4 over nccl, each held to colocated TP=4 and TP=2
  (``cross_tp``, which ``tests/test_tp_serving.py`` runs on the CPU with the tiny model)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

TRANSPORTS = ["nccl", "tcp"]  # --transports; the Mistral handoff uses the last
PROMPTS = ["Hello there", "The quick brown fox jumps over", "tensor parallel " * 6, "a b c d e f g"]
LAYOUTS = {
    "prefill-tp2-decode-tp1": ["--prefill-tp", "2", "--prefill-device", "cuda:0", "--decode-tp", "1",
                               "--decode-device", "cuda:1"],
    "prefill-tp1-decode-tp2": ["--prefill-tp", "1", "--prefill-device", "cuda:0", "--decode-tp", "2",
                               "--decode-device", "cuda:0"],
}


def complete(url: str, model: str, prompt: str, tokens: int, logprobs: int | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **({"logprobs": logprobs} if logprobs else {})}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]


def served(args: list[str], model: str, prompts: list[str], tokens: int, logprobs: int | None = None,
           check=None) -> list:
    """The prompts' completions from a cluster of ``pdserve up`` ``args``; ``check(url)`` runs before it stops."""
    from deploy.local import Cluster

    cluster = Cluster(*args, ready_timeout=300)
    try:
        cluster.wait_ready()
        got = [complete(cluster.url, model, p, tokens, logprobs) for p in prompts]
        if check is not None:
            check(cluster.url)
        return got
    finally:
        cluster.stop()


def tiny(report: dict) -> None:
    from engine import EngineConfig, SamplingParams
    from engine.engine import Engine
    from engine.generate import generate_many

    engine = Engine(EngineConfig(device="cpu", threads=4))
    want = [s.output_ids for _, s in generate_many(engine, [engine.tokenizer.encode(p) for p in PROMPTS],
                                                    [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
                                                     for _ in PROMPTS])]
    for name, layout in LAYOUTS.items():
        for transport in TRANSPORTS:
            try:
                got = served(["--transport", transport, "--dtype", "float32", *layout], "tiny-llama", PROMPTS, 24)
                ok = [c["token_ids"] for c in got] == want
            except Exception as e:  # noqa: BLE001 - recorded, the other layouts still run
                ok = f"{type(e).__name__}: {e}"[:300]
            report["tiny"][f"{name}/{transport}"] = ok
            print(f"tiny fp32 {name} over {transport}: tokens equal the reference: {ok}", flush=True)


def agreement(ref: list, other: list) -> dict:
    """How far ``other``'s greedy tokens follow ``ref``'s, and the largest logprob gap while they do."""
    first, delta = [], 0.0
    for a, b in zip(ref, other):
        same = 0
        for x, y, la, lb in zip(a["token_ids"], b["token_ids"], a["logprobs"]["token_logprobs"],
                                b["logprobs"]["token_logprobs"]):
            if x != y:
                break
            same += 1
            delta = max(delta, abs(la - lb))
        first.append(same)
    return {"tokens_agreeing_before_first_difference": first, "max_abs_logprob_delta_while_agreeing": delta,
            "first_logprobs": [b["logprobs"]["token_logprobs"][:4] for b in other]}


def mistral(report: dict, tokens: int = 16) -> None:
    """TP=1 colocated is the reference; colocated TP=2 (the same weights, another reduction order) is the bf16
    noise the handoff is judged against."""
    shape = ["--model", "mistral-7b", "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
             "--max-num-seqs", "16"]
    prompts = [p * 8 for p in PROMPTS]
    tp1 = served(["--colocated", "--device", "cuda:0", *shape], "mistral-7b", prompts, tokens, 5)
    tp2 = served(["--colocated", "--tp", "2", "--device", "cuda:0", *shape], "mistral-7b", prompts, tokens, 5)
    handoff = served(["--transport", TRANSPORTS[-1], *shape, *LAYOUTS["prefill-tp2-decode-tp1"]], "mistral-7b",
                     prompts, tokens, 5)
    report["mistral_7b_bf16"] = {"of": tokens, "tp1_first_logprobs": [a["logprobs"]["token_logprobs"][:4] for a in tp1],
                                 "colocated_tp2_vs_tp1": agreement(tp1, tp2),
                                 f"handoff_over_{TRANSPORTS[-1]}_vs_tp1": agreement(tp1, handoff)}
    print(json.dumps(report["mistral_7b_bf16"]), flush=True)


LAYOUTS8 = {  # issue 32's run 4: groups of four hand KV to groups of two and back, on 8 GPUs
    "prefill-tp4-to-two-decode-tp2": ["--prefill", "1", "--prefill-tp", "4", "--decode", "2", "--decode-tp", "2",
                                      "--gpus", "8"],
    "two-prefill-tp2-to-decode-tp4": ["--prefill", "2", "--prefill-tp", "2", "--decode", "1", "--decode-tp", "4",
                                      "--gpus", "8"],
}


def cross_tp(shape: list[str], model: str, refs: dict, layouts: dict, transport: str, tokens: int = 16,
             prompts: list[str] | None = None, check=None) -> dict:
    """Colocated references (``refs``: name -> ``pdserve up`` arguments, the first the one each is held to), then
    each handoff layout: greedy tokens and logprobs, how far each follows each reference. Two references of
    different TP differ by the bf16 noise a handoff is judged against (fp32: by nothing). ``check(url, name)``:
    more of each layout's cluster, before it stops."""
    prompts = prompts or [p * 8 for p in PROMPTS]
    runs = {name: served([*args, *shape], model, prompts, tokens, 5) for name, args in refs.items()}
    first = next(iter(refs))
    out = {"of": tokens, "references": {name: agreement(runs[first], runs[name]) for name in list(refs)[1:]}}
    for name, args in layouts.items():
        got = served(["--transport", transport, *args, *shape], model, prompts, tokens, 5,
                     check and (lambda url, name=name: check(url, name)))
        out[name] = {ref: agreement(runs[ref], got) for ref in refs}
    return out


def llama8(report: dict) -> None:
    """Llama-3-70B shape on 8 GPUs: colocated TP=4 and TP=2 as references, then the two layouts of ``LAYOUTS8``."""
    shape = ["--model", "llama-3-70b", "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
             "--max-num-seqs", "16"]
    refs = {"colocated-tp4": ["--colocated", "--tp", "4", "--device", "cuda:0"],
            "colocated-tp2": ["--colocated", "--tp", "2", "--device", "cuda:4"]}
    report["llama_70b_bf16_8gpu"] = cross_tp(shape, "llama-3-70b", refs, LAYOUTS8, TRANSPORTS[0])
    print(json.dumps(report["llama_70b_bf16_8gpu"]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out/tp-handoff")
    ap.add_argument("--skip", default="llama8", help="parts not to run, of tiny,mistral,llama8 (llama8: 8 GPUs)")
    ap.add_argument("--transports", default="nccl,tcp")
    args = ap.parse_args(argv)
    TRANSPORTS[:] = args.transports.split(",")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    report = {"command": "python -m bench.tp_handoff " + " ".join(sys.argv[1:]), "tiny": {}}
    for name, fn in (("tiny", tiny), ("mistral", mistral), ("llama8", llama8)):
        if name not in args.skip.split(","):
            try:
                fn(report)
            except Exception as e:  # noqa: BLE001 - keep what the other part found
                report[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
                print(report[f"{name}_error"], flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

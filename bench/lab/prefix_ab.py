"""Multi-turn chat with prefix caching on and off, side by side: ``pdserve up`` twice with the same model and
policy (the second with ``--no-prefix-caching``), the same ``bench serve --conversations`` workload against each,
and the ratio of turns 2..N's TTFT p50.

    python -m bench.lab.prefix_ab --model DIR [--up-args "..."] [--conversations 4 --turns 8 --system-len 2000]"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from deploy.local import Cluster


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.prefix_ab")
    ap.add_argument("--model", required=True)
    ap.add_argument("--up-args", default="--policy kv_aware", help="extra `pdserve up` arguments for both runs")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--question-len", default="60")
    ap.add_argument("--max-tokens", default="32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/out/prefix-ab")
    args = ap.parse_args(argv)
    from bench import serve

    results = {}
    for name, extra in (("cached", []), ("off", ["--no-prefix-caching"])):
        cluster = Cluster("--model", args.model, *shlex.split(args.up_args), *extra, threads=args.threads).wait_ready()
        try:
            load = serve._parser_defaults(url=cluster.url, conversations=args.conversations, turns=args.turns,
                                          system_len=args.system_len, prompt_len=args.question_len,
                                          max_tokens=args.max_tokens, concurrency=args.conversations,
                                          out=f"{args.out}-{name}")
            code = serve.run(load)
        finally:
            cluster.stop()
        with open(f"{args.out}-{name}.json") as f:
            results[name] = json.load(f)["summary"]
        if code:
            print(f"{name}: requests failed", file=sys.stderr)
    on, off = (results[k]["ttft_ms_turns_2_on"]["median"] for k in ("cached", "off"))
    report = {"command": "python -m bench.lab.prefix_ab " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "ttft_p50_turns_2_on_ms": {"cached": on, "off": off}, "ratio": on / off if off else None,
              "ttft_p50_turn_1_ms": {k: results[k]["ttft_ms_turn_1"]["median"] for k in results},
              "kv_bytes_p50_turns_2_on": {k: results[k]["kv_bytes_turns_2_on"]["median"] for k in results},
              "summaries": results}
    with open(f"{args.out}.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in report if k != "summaries"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

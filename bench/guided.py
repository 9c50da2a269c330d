"""``pdserve bench guided``: xgrammar against llguidance for the structured outputs pdserve enforces.

For each vocabulary (the byte tokenizer, 259 tokens; a Hugging Face tokenizer of ``--vocab`` tokens built from
the byte tokenizer plus ``[i]`` tokens, no download) and each grammar (a nested JSON schema, a regex, a choice):
compile time (first, uncached), and the time to fill one row's token bitmask and accept a token, averaged over
``--steps`` steps of a random walk the grammar allows (the same seed for both). With ``--model`` also engine
decode at ``--batch`` sequences of ``--prompt-len`` tokens, every one guided by a JSON schema (an array of at
least 4,096 small integers: none ends while timed) against none, in the same run, alternating, the better of two
runs each: tok/s and the slowdown (the issue's bar: 5%). A named shape with dummy weights is given a tokenizer of
its full vocabulary, so the masks cost what a real model's would.
Writes JSON and Markdown."""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

from .report import command_line

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "inner"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "maxItems": 4,
                                                                               "items": {"enum": ["a", "b", "c"]}},
                         "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999}},
                                   "required": ["n"], "additionalProperties": False}}}
GRAMMARS = {"json_schema": SCHEMA, "regex": r"[A-Z]{2}-\d{3}(-[a-z]{1,8})?", "choice": ["alpha", "beta", "gamma"]}


def add_arguments(p):
    p.add_argument("--vocab", type=int, default=32000, help="size of the large (Hugging Face) vocabulary")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default=None, help="also time engine decode guided vs not (e.g. mistral-7b with "
                   "--load-format dummy)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--out", default="bench/out/guided")


def hf_tokenizer(vocab: int):
    from transformers import AutoTokenizer

    from engine.tokenizer import save_byte_tokenizer

    with tempfile.TemporaryDirectory(prefix="pdserve-vocab-") as path:
        save_byte_tokenizer(path, vocab)
        return AutoTokenizer.from_pretrained(path)  # read whole into memory: the folder can go


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, len(hf)
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf)), max_threads=1)

    def matcher(self, kind, value):
        c = self.compiler
        grammar = {"json_schema": lambda: c.compile_json_schema(json.dumps(value), any_whitespace=False),
                   "regex": lambda: c.compile_regex(value),
                   "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(v) for v in value))}[kind]()
        return self.xgr.GrammarMatcher(grammar), self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, state):
        matcher, bitmask = state
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask

    def accept(self, state, token):
        return state[0].accept_token(token)

    def done(self, state):
        return state[0].is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt, self.vocab = llguidance, llguidance.torch, len(hf)
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))

    def matcher(self, kind, value):
        ll = self.ll
        grammar = {"json_schema": lambda: ll.grammar_from("json_schema", json.dumps(value)),
                   "regex": lambda: ll.grammar_from("regex", value),
                   "choice": lambda: ll.grammar_from("lark", "start: " + " | ".join(json.dumps(v) for v in value))
                   }[kind]()
        return ll.LLMatcher(self.tokenizer, grammar), self.llt.allocate_token_bitmask(1, self.vocab)

    def fill(self, state):
        matcher, bitmask = state
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask

    def accept(self, state, token):
        return state[0].consume_token(token)

    def done(self, state):
        return state[0].is_stopped()


def allowed(bitmask, vocab: int) -> list[int]:
    words = bitmask[0].tolist()
    return [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]


def measure(engine, kind, value, steps: int, seed: int) -> dict:
    start = time.perf_counter()
    state = engine.matcher(kind, value)
    compile_ms = (time.perf_counter() - start) * 1e3
    rng, fill_s, tokens = random.Random(seed), 0.0, 0
    while tokens < steps:
        if engine.done(state):
            state = engine.matcher(kind, value)  # a fresh walk
        t0 = time.perf_counter()
        bitmask = engine.fill(state)
        fill_s += time.perf_counter() - t0
        choices = allowed(bitmask, engine.vocab)
        engine.accept(state, rng.choice(choices))
        tokens += 1
    return {"compile_ms": compile_ms, "fill_accept_us": fill_s / steps * 1e6}


ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 4096}  # never ends


def model_dir(args) -> str:
    """A named shape with dummy weights gets a directory holding its config and a tokenizer of the shape's full
    vocabulary (``[i]`` tokens past the bytes), so the guides mask over as many tokens as the real model's would."""
    from engine.models.presets import SHAPES, preset_config
    from engine.tokenizer import save_byte_tokenizer

    if args.load_format != "dummy" or args.model not in SHAPES:
        return args.model
    path = tempfile.mkdtemp(prefix=f"pdserve-{args.model}-")
    config = preset_config(args.model)
    config.save_pretrained(path)
    save_byte_tokenizer(path, config.vocab_size)
    return path


def decode_ab(args) -> dict:
    """Decode tok/s of ``batch`` sequences unguided, then guided (same engine, same prompts)."""
    from engine import EngineConfig
    from engine.factory import make_engine

    from .engine import decode_rate

    engine = make_engine(EngineConfig(model=model_dir(args), load_format=args.load_format, dtype=args.dtype,
                                      device=args.device, max_num_seqs=max(args.batch, 8)))
    getattr(engine, "warm_up", lambda: None)()
    out = {}
    cases = [("free", None), ("json_schema", {"kind": "json_schema", "value": ARRAY})] * 2  # each twice, the best
    for name, guide in cases:
        d = decode_rate(engine, args.batch, args.prompt_len, args.decode_steps, random.Random(0), guide=guide)
        if name not in out or d["tok_per_s"] > out[name]["tok_per_s"]:
            out[name] = {"tok_per_s": d["tok_per_s"], "step_ms": d["step_ms"]}
        print(f"decode batch {args.batch} {name:11}: {d['tok_per_s']:9.1f} tok/s ({d['step_ms']:.2f} ms/step)",
              file=sys.stderr)
    out["slowdown"] = out["free"]["tok_per_s"] / out["json_schema"]["tok_per_s"] - 1
    if hasattr(engine, "close"):
        engine.close()
    return out


def run(args) -> int:
    from engine.tokenizer import ByteTokenizer  # noqa: F401 (the byte vocabulary is the small case)

    rows = []
    for vocab in (None, args.vocab):
        hf = hf_tokenizer(vocab or 0)
        for cls in (XGrammar, LLGuidance):
            try:
                engine = cls(hf)
            except Exception as e:  # not installed, or this tokenizers release is one it cannot read
                print(f"{cls.name}: unavailable ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            for kind, value in GRAMMARS.items():
                r = measure(engine, kind, value, args.steps, 0)
                rows.append({"engine": cls.name, "vocab": len(hf), "grammar": kind, **r})
                print(f"{cls.name:10} vocab {len(hf):>6} {kind:11}: compile {r['compile_ms']:8.2f} ms, mask+accept "
                      f"{r['fill_accept_us']:8.1f} us/token", file=sys.stderr)
    decode = decode_ab(args) if args.model else None
    md = ["| engine | vocab | grammar | compile ms | mask + accept us/token |", "|---|---|---|---|---|"]
    md += [f"| {r['engine']} | {r['vocab']} | {r['grammar']} | {r['compile_ms']:.2f} | {r['fill_accept_us']:.1f} |"
           for r in rows]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command_line("guided"), "rows": rows, "decode": decode}, f, indent=1)
    if decode:
        md += ["", f"Engine decode, {args.model}, batch {args.batch} x {args.prompt_len}: "
               f"{decode['free']['tok_per_s']:.1f} tok/s free, {decode['json_schema']['tok_per_s']:.1f} with a JSON "
               f"schema on every sequence: {100 * decode['slowdown']:.1f}% slower per token."]
    with open(args.out + ".md", "w") as f:
        f.write(f"`{command_line('guided')}`\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))
    return 0

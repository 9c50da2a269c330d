"""What the Triton kernel tests share: Triton's interpreter where there is no GPU (``TRITON_INTERPRET=1``, read when
the kernels are defined, so this module is imported before any of them), the device the tensors go to, and the mark
that skips a module where triton is missing."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches ``triton.language`` at each launch (and undoes it after), and again, never undone,
    at each call of a ``@triton.jit`` helper inside the kernel: ~2 ms a call, a third of a tiny engine's time on the
    kernels. Inside a launch a helper whose modules (``tl``, ``tl.core``) are already patched skips it. Versions
    whose interpreter is laid out otherwise keep their own behaviour."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        launch, patch = interpreter.GridExecutor.__call__, interpreter._patch_lang
    except (ImportError, AttributeError):
        return
    patched: set | None = None  # the language modules patched in the launch running now
    langs_of: dict = {}

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if patched is not None and langs <= patched:
            return interpreter._LangPatchScope()  # nothing to undo
        if patched is not None:
            patched.update(langs)
        return patch(fn)

    def launch_patching_once(self, *args, **kwargs):
        nonlocal patched
        patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = None

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_once, launch_patching_once


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _patch_the_language_once_a_launch()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")


_BUILD = """
import json, sys
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for module, name, signature, constexprs, *options in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options=options[0] if options else None)
        out.append({"ptx": kernel.asm["ptx"], "cubin_bytes": len(kernel.asm["cubin"])})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"[-3000:]})
print(json.dumps(out))
"""


def compile_for_hopper(cases: list) -> list:
    """Each ``(module, kernel name, signature, constexprs[, options])`` built for sm_90a with Triton's own ptxas, no GPU needed:
    what the interpreter cannot check (PTX that ptxas refuses). In a process of its own, without the interpreter
    (whose kernels cannot be compiled). ``[{"ptx", "cubin_bytes"} or {"error"}]``; skips where Triton has no ptxas."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _BUILD], input=json.dumps(cases), capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    missing = [r["error"] for r in results if "error" in r and "ptxas" in r["error"] and "rror   :" not in r["error"]
               and "No such file" in r["error"]]
    if missing:
        pytest.skip(f"no ptxas here: {missing[0][:200]}")
    return results

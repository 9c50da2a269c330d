"""An OpenAI-compatible load tool nobody here wrote (GuideLLM) against ``pdserve up`` for 30 s: no errors."""
import json
import os
import shutil
import subprocess

import pytest

from tests.checkpoints import write_checkpoint


@pytest.mark.skipif(shutil.which("guidellm") is None, reason="guidellm not installed")
def test_guidellm_runs_clean_against_pdserve_up(disagg, tmp_path):
    tokenizer = write_checkpoint(tmp_path / "tok")
    out = tmp_path / "guidellm.json"
    cmd = ["guidellm", "run", f"--backend=kind=openai_http,target={disagg.url},model=tiny-llama",
           f"--tokenizer=kind=hf_auto,model={tokenizer}", "--data=kind=synthetic_text,prompt_tokens=64,output_tokens=32",
           "--profile=kind=concurrent,streams=4", "--constraint=kind=max_duration,seconds=8",
           f"--output=kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 20, totals

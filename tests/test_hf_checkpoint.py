"""A local Hugging Face checkpoint directory loads and generates like the built-in model it was saved from."""
import pytest

from engine import EngineConfig, SamplingParams
from engine.generate import generate
from engine.runner import ModelRunner
from engine.tiny import build_tiny_model
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-hf"))


def test_checkpoint_dir_matches_builtin_model(checkpoint):
    hf = ModelRunner(EngineConfig(model=checkpoint, threads=1))
    tiny = ModelRunner(EngineConfig(threads=1))
    assert hf.name == "tiny-hf0" and hf.max_len == tiny.max_len
    ids = tiny.tokenizer.encode("Hello there")
    assert hf.tokenizer.encode("Hello there", add_bos=False) == ids[1:]
    params = dict(max_tokens=16, temperature=0)
    got, want = generate(hf, ids, SamplingParams(**params)), generate(tiny, ids, SamplingParams(**params))
    assert got[1] == want[1] and got[0] == want[0]


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        ModelRunner(EngineConfig(model=str(tmp_path / "nope")))

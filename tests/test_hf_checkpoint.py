"""A local Hugging Face checkpoint directory loads and generates like the built-in model it was saved from."""
import pytest

from engine import EngineConfig, SamplingParams
from engine.generate import generate
from engine.engine import Engine
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-hf"))


def test_checkpoint_dir_matches_builtin_model(checkpoint):
    hf = Engine(EngineConfig(model=checkpoint, threads=1))
    tiny = Engine(EngineConfig(threads=1))
    assert hf.name == "tiny-hf0" and hf.max_len == tiny.max_len
    ids = tiny.tokenizer.encode("Hello there")
    assert hf.tokenizer.encode("Hello there", add_bos=False) == ids[1:]
    params = dict(max_tokens=16, temperature=0)
    got, want = generate(hf, ids, SamplingParams(**params)), generate(tiny, ids, SamplingParams(**params))
    assert got[1] == want[1] and got[0] == want[0]


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if not (loop.last and continue_final_message) %}</s>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_checkpoint(tmp_path_factory.mktemp("tiny-chat"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return Engine(EngineConfig(model=path, threads=1))


def test_chat_template_is_tokenized_once(templated):
    tok = templated.tokenizer
    msgs = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(msgs)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids).endswith("<|assistant|>")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == ids[:-len(tok.encode("<|assistant|>", add_bos=False))]
    cont = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "Yo"}], False, True)
    assert tok.decode(cont).endswith("<|assistant|>Yo")


def test_chat_through_the_engine_has_one_bos(templated):
    from engine.requests import new_sequence

    seq = new_sequence(templated, "r", {"messages": [{"role": "user", "content": "Hi"}], "params": {"max_tokens": 3}})
    assert seq.prompt_ids.count(templated.tokenizer.bos_token_id) == 1
    assert seq.prompt_ids == templated.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])

"""Tokenization as the model's tokenizer does it: the trainer's examples, the engine's prompts and
`harli-train generate` against transformers, with and without a BOS post-processor; stop tokens from
generation_config.json."""

import json

import pytest
import torch
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.data import IGNORE_INDEX, ByteTokenizer, load_tokenizer
from harli_train.data.tokenization import prompt_completion_example, prompt_ids, text_example
from harli_train.engine import EngineConfig, SamplingParams
from harli_train.engine.api import build_engine

from .hf_tokenizers import build_bpe_tokenizer_dir, build_hf_model_dir

PROMPT = "hello world, the cat"


def _hf_greedy(model, tok, prompt, max_tokens):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("kind", ["llama", "no-bos"])
def test_generate_equals_transformers_with_and_without_a_bos_post_processor(tmp_path, kind):
    model, tok = build_hf_model_dir(tmp_path, kind)
    expected = tok(PROMPT).input_ids
    assert (expected[0] == tok.bos_token_id) == (kind == "llama")  # the two kinds differ where it matters
    tokenizer = load_tokenizer(str(tmp_path), is_preset=False)
    assert tokenizer.bos_id is not None  # both define a BOS; only the rules say whether a prompt gets it
    assert prompt_ids(tokenizer, PROMPT) == expected

    hf_ids = _hf_greedy(model, tok, PROMPT, 12)
    result = CliRunner().invoke(
        main,
        ["generate", "--model", str(tmp_path), "--prompt", PROMPT, "--max-tokens", "12", "--device", "cpu"],
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == PROMPT + tok.decode(hf_ids, skip_special_tokens=True)
    engine = build_engine(str(tmp_path), "cpu", config=EngineConfig(max_model_len=64))
    (seq,) = engine.generate([PROMPT], SamplingParams(max_tokens=12))
    assert seq.token_ids[: seq.num_prompt_tokens] == expected and seq.completion_token_ids == hf_ids


def test_the_engine_stops_on_generation_config_eos_as_transformers_does(tmp_path):
    model, tok = build_hf_model_dir(tmp_path, "no-bos")
    free = build_engine(str(tmp_path), "cpu", config=EngineConfig(max_model_len=64))
    (run,) = free.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    stop = run.completion_token_ids[2]  # a token greedy decoding reaches: make it an end-of-turn token
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [config["eos_token_id"], stop]})
    )
    engine = build_engine(str(tmp_path), "cpu", config=EngineConfig(max_model_len=64))
    assert engine.scheduler.eos_ids == {config["eos_token_id"], stop}
    (seq,) = engine.generate([PROMPT], SamplingParams(max_tokens=6))
    assert seq.finish_reason == "eos" and seq.completion_token_ids[-1] == stop
    assert seq.completion_token_ids == run.completion_token_ids[: len(seq.completion_token_ids)]
    model.generation_config.eos_token_id = [config["eos_token_id"], stop]
    assert seq.completion_token_ids == _hf_greedy(model, tok, PROMPT, 6)


@pytest.mark.parametrize("kind", ["llama", "no-bos"])
def test_prompt_and_completion_are_tokenized_together_and_masked_by_the_prompt(tmp_path, kind):
    tok = build_bpe_tokenizer_dir(tmp_path, kind)
    tokenizer = load_tokenizer(str(tmp_path), is_preset=False)
    for prompt, completion in (("What is 12 + 34?", " It is 46."), ("the ca", "t sat on the mat")):
        ex = prompt_completion_example(tokenizer, prompt, completion)
        assert ex.input_ids == tok(prompt + completion).input_ids + [tok.eos_token_id]
        head = tok(prompt).input_ids
        n = next(i for i, (a, b) in enumerate(zip(head + [-1], ex.input_ids, strict=False)) if a != b)
        assert ex.labels == [IGNORE_INDEX] * n + ex.input_ids[n:]
    # "cat" is one token: the prompt's "ca" merges with the completion's "t", and that token is learned.
    merged = prompt_completion_example(tokenizer, "the ca", "t sat on the mat")
    assert len(tok("the ca").input_ids) > sum(label == IGNORE_INDEX for label in merged.labels)
    text = text_example(tokenizer, "the cat sat")
    assert text.input_ids == tok("the cat sat").input_ids + [tok.eos_token_id]
    assert text.labels[0] == (IGNORE_INDEX if kind == "llama" else text.input_ids[0])


def test_byte_presets_keep_their_bos_rule():
    tok = ByteTokenizer()
    assert prompt_ids(tok, "ab") == [tok.bos_id, 97, 98]
    ex = prompt_completion_example(tok, "ab", "c")
    assert ex.input_ids == [tok.bos_id, 97, 98, 99, tok.eos_id]
    assert ex.labels == [IGNORE_INDEX] * 3 + [99, tok.eos_id]

"""Our Llama against transformers' on the same weights (fp32, CPU); broken model files named in one line."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.model import ModelError, load_model

from .hf_models import save_tiny_llama


def _hf_llama(tmp_path, **overrides):
    settings = dict(vocab_size=97, rope_theta=10000.0, rms_norm_eps=1e-5)
    return save_tiny_llama(tmp_path, **{**settings, **overrides})


def _hf_qwen2(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.05) if "norm" not in n else p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model


def _compare(hf, ours, vocab, lengths=(1, 7, 33)):
    torch.manual_seed(2)
    for t in lengths:
        ids = torch.randint(0, vocab, (2, t))
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            got = ours.logits(ours(ids))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_llama_logits_match_transformers(tmp_path):
    hf = _hf_llama(tmp_path)
    _compare(hf, load_model(str(tmp_path), torch.float32, "cpu"), 97)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500000.0,
    }
    hf = _hf_llama(tmp_path, rope_scaling=rope, rope_theta=500000.0, tie_word_embeddings=True)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    assert ours.config.rope_scaling is not None and ours.config.tie_word_embeddings
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    _compare(hf, ours, 97, lengths=(5, 40))


def test_qwen2_logits_match_transformers(tmp_path):
    hf = _hf_qwen2(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    assert ours.config.attention_bias
    _compare(hf, ours, 101)


def test_explicit_positions_equal_default():
    m = load_model("tiny", torch.float32, "cpu")
    ids = torch.randint(0, 320, (1, 12))
    pos = torch.arange(12).unsqueeze(0)
    torch.testing.assert_close(m(ids), m(ids, positions=pos))


def test_random_presets_are_seeded():
    a = load_model("tiny", torch.float32, "cpu", seed=3)
    b = load_model("tiny", torch.float32, "cpu", seed=3)
    c = load_model("tiny", torch.float32, "cpu", seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_missing_model_directory_names_what_it_looked_for(tmp_path):
    with pytest.raises(ModelError, match="neither a preset"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 10, "hidden_size": 8, '
        '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}'
    )
    with pytest.raises(ModelError, match="no weights found"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_a_truncated_weights_file_names_the_file(tiny_hf_dir):
    path, _ = tiny_hf_dir
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    for cut in (len(data) // 2, 5):  # data cut short; the header itself cut short
        weights.write_bytes(data[:cut])
        with pytest.raises(ModelError) as info:
            load_model(str(path), torch.float32, "cpu")
        assert str(info.value).startswith(f"{weights}: not a readable safetensors file (")
        assert "it may be truncated" in str(info.value)
    (path / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(ModelError, match=r"model.safetensors.index.json: not a safetensors index"):
        load_model(str(path), torch.float32, "cpu")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [c], "expected a JSON object of model settings, got a JSON list"),
        (lambda c: {**c, "hidden_size": "32"}, 'hidden_size: expected an integer, got a JSON string "32"'),
        (
            lambda c: {**c, "num_hidden_layers": 2.5},
            "num_hidden_layers: expected an integer, got a JSON number",
        ),
        (lambda c: {**c, "tie_word_embeddings": "no"}, "tie_word_embeddings: expected true or false"),
        (lambda c: {**c, "rms_norm_eps": True}, "rms_norm_eps: expected a number, got a JSON boolean true"),
        (
            lambda c: {**c, "eos_token_id": [2, "x"]},
            "eos_token_id: expected an integer or a list of integers",
        ),
        (lambda c: {**c, "rope_scaling": "llama3"}, "rope_scaling: expected an object"),
        (lambda c: {**c, "num_attention_heads": 0}, "num_heads must be positive, got 0"),
        (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size: missing"),
    ],
)
def test_a_config_json_of_the_wrong_shape_names_the_file_and_key(tiny_hf_dir, edit, message):
    path, _ = tiny_hf_dir
    config = path / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    with pytest.raises(ModelError) as info:
        load_model(str(path), torch.float32, "cpu")
    assert str(info.value).startswith(f"{config}: ") and message in str(info.value), str(info.value)


def test_a_config_json_that_is_not_json_names_the_file(tiny_hf_dir):
    path, _ = tiny_hf_dir
    for text in (b'{"vocab_size": 96,', b'{"model_type": "llama\xff"}'):
        (path / "config.json").write_bytes(text)
        with pytest.raises(ModelError, match=r"config.json: not a JSON file"):
            load_model(str(path), torch.float32, "cpu")


def test_the_cli_reports_a_broken_model_with_exit_2(tiny_hf_dir):
    path, _ = tiny_hf_dir
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"])
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: {weights}: not a readable safetensors file")

"""Chat data: conversations rendered with the model's chat template (Llama-3 and Qwen2.5, on tokenizer files
made here), the loss on the assistant turns, alpaca and sharegpt rows mapped onto chat, the stop tokens of a
chat model, and `generate --chat` against transformers."""

import json

import pytest
import torch
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.data import IGNORE_INDEX, ByteTokenizer, DataError, load_examples, load_tokenizer
from harli_train.data.tokenization import chat_example
from harli_train.engine import EngineConfig, SamplingParams
from harli_train.engine.api import build_engine

from .hf_tokenizers import CHATML_GENERATION_TEMPLATE, build_bpe_tokenizer_dir, build_hf_model_dir
from .test_data import QUICKSTART, write_jsonl

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "It is 46."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse!"},
]
END_OF_TURN = {"llama-3": "<|eot_id|>", "qwen2.5": "<|im_end|>"}


def _learned_runs(tok, ex):
    """The text of each run of consecutive learned tokens (special tokens shown)."""
    runs, run = [], []
    for t, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = runs + [run], []
    return [tok.decode(r) for r in runs + ([run] if run else [])]


@pytest.mark.parametrize("kind", ["llama-3", "qwen2.5"])
def test_a_chat_template_renders_the_conversation_and_the_loss_falls_on_the_assistant_turns(tmp_path, kind):
    tok = build_bpe_tokenizer_dir(tmp_path / "tok", kind)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    (ex,) = load_examples(data, "auto", load_tokenizer(str(tmp_path / "tok"), is_preset=False))
    assert ex.input_ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    if kind == "llama-3":  # the template writes BOS; the post-processor's is not added on top
        assert ex.input_ids[0] == tok.bos_token_id and ex.input_ids.count(tok.bos_token_id) == 1
    else:
        assert tok.bos_token_id is None and "You are Qwen" not in tok.decode(ex.input_ids)  # own system turn
    end = END_OF_TURN[kind]
    assert _learned_runs(tok, ex) == [CONVERSATION[2]["content"] + end, CONVERSATION[4]["content"] + end]
    every = chat_example(load_tokenizer(str(tmp_path / "tok"), is_preset=False), CONVERSATION, "all")
    assert every.input_ids == ex.input_ids and every.labels == every.input_ids


def test_generation_blocks_and_turn_by_turn_rendering_locate_the_same_tokens(tmp_path, monkeypatch):
    # transformers' return_assistant_tokens_mask (the template's {% generation %} blocks) is the reference
    # for the turn-by-turn rendering used with templates that have none.
    build_bpe_tokenizer_dir(tmp_path, "qwen2.5", template=CHATML_GENERATION_TEMPLATE)
    tokenizer = load_tokenizer(str(tmp_path), is_preset=False)
    assert tokenizer.has_generation_tags
    tagged = chat_example(tokenizer, CONVERSATION)
    monkeypatch.setattr(tokenizer, "has_generation_tags", False)
    rendered = chat_example(tokenizer, CONVERSATION)
    assert rendered == tagged and sum(label != IGNORE_INDEX for label in tagged.labels) > 10


def test_alpaca_and_sharegpt_rows_are_chats(tmp_path):
    build_bpe_tokenizer_dir(tmp_path / "tok", "qwen2.5")
    tokenizer = load_tokenizer(str(tmp_path / "tok"), is_preset=False)
    alpaca = [
        {"instruction": "Add the numbers.", "input": "12 + 34", "output": "46"},
        {"instruction": "Say hello.", "input": "", "output": "hello", "system": "Be brief."},
    ]
    chats = [
        [{"role": "user", "content": "Add the numbers.\n12 + 34"}, {"role": "assistant", "content": "46"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "hello"},
        ],
    ]
    want = [chat_example(tokenizer, c) for c in chats]
    assert load_examples(write_jsonl(tmp_path / "a.jsonl", alpaca), "auto", tokenizer) == want
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [
        {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in c]} for c in chats
    ]
    assert load_examples(write_jsonl(tmp_path / "s.jsonl", sharegpt), "sharegpt", tokenizer) == want


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": "hi"}, "field 'messages' must be a list of messages, got str"),
        ({"messages": [{"role": "user"}]}, r"messages\[1\].content must be a string, got nothing"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant text to learn"),
        (
            {"conversations": [{"from": "observation", "value": "x"}]},
            r"conversations\[1\].from is 'observation'",
        ),
        ({"instruction": "a", "output": 3}, "field 'output' must be a string, got int"),
    ],
)
def test_bad_chat_rows_name_the_file_and_line(tmp_path, row, message):
    build_bpe_tokenizer_dir(tmp_path / "tok", "qwen2.5")
    good = {
        "messages": {"messages": CONVERSATION},
        "conversations": {
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
        },
        "instruction": {"instruction": "hi", "output": "yo"},
    }
    path = write_jsonl(tmp_path / "bad.jsonl", [next(v for k, v in good.items() if k in row), row])
    with pytest.raises(DataError, match=message) as e:
        load_examples(path, "auto", load_tokenizer(str(tmp_path / "tok"), is_preset=False))
    assert str(e.value).startswith(f"{path}:2: ")


def test_chat_data_without_a_chat_template_names_the_model(tmp_path):
    build_bpe_tokenizer_dir(tmp_path / "tok", "llama")  # no template
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    for fmt in ("auto", "chat"):
        with pytest.raises(DataError) as e:
            load_examples(data, fmt, load_tokenizer(str(tmp_path / "tok"), is_preset=False))
        assert str(e.value).startswith(f"{tmp_path / 'tok'}: the tokenizer has no chat template")
    result = CliRunner().invoke(
        main, [str(QUICKSTART), f"data.path={data}", "data.format=chat", f"output.dir={tmp_path / 'run'}"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "preset 'tiny' (a byte-level tokenizer): the tokenizer has no chat template" in result.output
    with pytest.raises(DataError, match="has no chat template"):
        chat_example(ByteTokenizer(), CONVERSATION)


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_way_out(tmp_path):
    # Like templates that drop earlier turns' reasoning: the conversation so far is no prefix of the whole.
    template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\\n(earlier)<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    build_bpe_tokenizer_dir(tmp_path, "qwen2.5", template=template)
    with pytest.raises(
        DataError, match=r"does not render a conversation's turns as a prefix.*data.train_on: all"
    ):
        chat_example(load_tokenizer(str(tmp_path), is_preset=False), CONVERSATION)


@pytest.mark.parametrize("kind", ["llama-3", "qwen2.5"])
def test_a_chat_models_stop_tokens_and_generate_chat_equal_transformers(tmp_path, kind):
    model, tok = build_hf_model_dir(tmp_path, kind)
    engine = build_engine(str(tmp_path), "cpu", config=EngineConfig(max_model_len=128))
    # config.json names one EOS; generation_config.json adds the end-of-turn token (Llama-3's <|eot_id|>).
    want = {
        tok.convert_tokens_to_ids(t)
        for t in (END_OF_TURN[kind], "<|end_of_text|>" if kind == "llama-3" else "<|endoftext|>")
    }
    assert engine.scheduler.eos_ids == want
    question = CONVERSATION[1]["content"]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        prompt = torch.tensor(
            [ids]
        )  # an explicit mask: generate would mask a prompt token equal to pad_token_id
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    answer = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(tmp_path),
            "--chat",
            "--prompt",
            question,
            "--max-tokens",
            "10",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == answer
    (seq,) = engine.generate([ids], SamplingParams(max_tokens=10))
    assert seq.completion_token_ids == out[0, len(ids) :].tolist()


def test_chat_data_trains_through_the_cli(tmp_path):
    build_hf_model_dir(tmp_path / "model", "llama-3")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ]
        }
        for i in range(40)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run = tmp_path / "run"
    args = [
        str(QUICKSTART),
        f"model.name={tmp_path / 'model'}",
        f"data.path={data}",
        "data.format=chat",
        "data.seq_len=64",
    ]
    args += ["train.steps=2", "train.warmup_steps=0", "train.batch_size=2", f"output.dir={run}", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)

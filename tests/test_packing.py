"""Packing without cross-contamination: a packed row's documents see only themselves (block-diagonal causal
mask, positions restarting per document), so each document's losses and gradients are those it has alone;
transformers' own packed-sequence attention (position_ids) agrees."""

import pytest
import torch
import torch.nn.functional as F

from harli_train import kernels
from harli_train.data import IGNORE_INDEX, DataLoader, Example
from harli_train.data.loader import eval_batches
from harli_train.model import ModelConfig, load_model
from harli_train.model.attention import DocumentAttention
from harli_train.model.llama import LlamaForCausalLM
from harli_train.model.loader import init_random_weights
from harli_train.train.step import train_step

from .test_train import _drain

LENGTHS = [5, 9, 7]  # one row of 21 tokens


def _examples(lengths, vocab=259, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        labels = list(ids)
        labels[: n // 3] = [IGNORE_INDEX] * (n // 3)  # a prompt
        out.append(Example(ids, labels))
    return out


def _model():
    m = load_model("tiny", torch.float32, "cpu", seed=3)
    m.add_lora(4, 8.0, 0.0, seed=4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.lora_parameters():
            p.normal_(0, 0.05, generator=g)  # non-zero B so every gradient is non-trivial
    return m


def _token_losses(model, batch):
    attn = DocumentAttention(batch["doc_ids"]) if "doc_ids" in batch else None
    logits = model.logits(model(batch["input_ids"], batch.get("positions"), attn))
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )


def test_packed_rows_carry_doc_ids_and_positions_that_restart_per_document():
    lengths = [5, 9, 3, 12, 7, 4, 8, 6, 10, 2, 11]
    examples = [Example([1000 + i] * n, [2000 + i] * n) for i, n in enumerate(lengths)]
    loader = DataLoader(examples, batch_size=2, seq_len=9, pad_id=0, shuffle=False)
    stream_pos = 0
    for _ in range(loader.batches_per_epoch):
        batch = loader.next_batch()
        ids, docs, pos, labels = batch["input_ids"], batch["doc_ids"], batch["positions"], batch["labels"]
        assert docs.shape == pos.shape == ids.shape == (2, 9)
        for r in range(2):
            for t in range(9):
                doc = int(ids[r, t]) - 1000
                doc_start = sum(lengths[:doc])
                assert docs[r, t] == doc
                # From the document's start, or the row's for a document that began in an earlier row.
                assert pos[r, t] == stream_pos - max(doc_start, stream_pos - t)
                assert labels[r, t] == (IGNORE_INDEX if stream_pos == doc_start else 2000 + doc)
                stream_pos += 1
    padded = DataLoader(examples, batch_size=2, seq_len=9, pad_id=0, packing=False).next_batch()
    assert "doc_ids" not in padded and torch.equal(padded["positions"], torch.arange(9).expand(2, 9))


def test_a_packed_rows_losses_equal_each_example_run_alone():
    model = _model()
    examples = _examples(LENGTHS)
    packed = DataLoader(examples, batch_size=1, seq_len=sum(LENGTHS), pad_id=0, shuffle=False).next_batch()
    with torch.no_grad():
        losses = _token_losses(model, packed)[0]
        start = 0
        for e in examples:
            alone = {"input_ids": torch.tensor([e.input_ids]), "labels": torch.tensor([e.labels])}
            n = len(e.input_ids)
            ref = _token_losses(model, alone)[0]
            # Position start + t of the row predicts the document's token t + 1; the token before the
            # document (the previous one's last) predicts nothing of it.
            torch.testing.assert_close(losses[start : start + n - 1], ref, rtol=0, atol=2e-5)
            if start:
                assert losses[start - 1] == 0  # its first label is ignored
            start += n
    # Not vacuous: attending across the documents (one causal row) changes the later documents' losses.
    with torch.no_grad():
        plain = _token_losses(model, {k: packed[k] for k in ("input_ids", "labels")})[0]
    assert not torch.allclose(plain[LENGTHS[0] :], losses[LENGTHS[0] :], atol=1e-3)


@pytest.mark.parametrize("per_chunk", [1, 4])
def test_a_packed_steps_gradients_equal_those_of_its_examples_alone(per_chunk):
    examples = _examples(LENGTHS, seed=1)
    packed = DataLoader(examples, batch_size=1, seq_len=sum(LENGTHS), pad_id=0, shuffle=False).next_batch()
    alone = [{"input_ids": torch.tensor([e.input_ids]), "labels": torch.tensor([e.labels])} for e in examples]
    for b in alone:
        b["num_target_tokens"] = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())

    def grads(batches):
        m = _model()
        result, _ = _drain(train_step(m, batches, per_chunk))
        return result, [p.grad for p in m.lora_parameters()]

    got, want = grads([packed]), grads(alone)
    assert got[0].target_tokens == want[0].target_tokens
    torch.testing.assert_close(got[0].loss_sum, want[0].loss_sum, rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_packed_logits_equal_transformers_packed_sequences(tiny_hf_dir):
    # transformers reads packing from position_ids that restart (no attention_mask, no cache): its own mask.
    path, hf = tiny_hf_dir
    ours = load_model(str(path), torch.float32, "cpu")
    examples = _examples([6, 11, 4, 9], vocab=96, seed=2)
    batch = DataLoader(examples, batch_size=2, seq_len=15, pad_id=0, shuffle=False).next_batch()
    assert batch["positions"][0].tolist() != list(range(15))  # the rows do pack several documents
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], position_ids=batch["positions"], use_cache=False).logits
        got = ours.logits(ours(batch["input_ids"], batch["positions"], DocumentAttention(batch["doc_ids"])))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_packed_steps_through_the_triton_kernels_equal_the_torch_reference():
    # Per-row rope tables ([B, T, D] from per-document positions) through the Triton rope kernel (CPU
    # interpreter), with the block-diagonal mask, on a small model.
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
    )
    examples = _examples([5, 9, 7, 3, 8], vocab=64, seed=5)
    batch = DataLoader(examples, batch_size=2, seq_len=16, pad_id=0, shuffle=False).next_batch()

    def run(backend):
        m = LlamaForCausalLM(cfg)
        init_random_weights(m, seed=6)
        m.add_lora(4, 8.0, 0.0, seed=7)
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for p in m.lora_parameters():
                p.normal_(0, 0.05, generator=g)
        with kernels.use_backend(backend):
            result, _ = _drain(train_step(m, [batch], 1))
        return result.loss_sum, [p.grad for p in m.lora_parameters()]

    (ref_loss, ref_grads), (loss, got_grads) = run("torch"), run("triton")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_eval_batches_hold_every_example_once_and_whole():
    model = _model()
    examples = _examples([5, 9, 7, 3, 8, 6, 20])  # rows of 16: [5, 9], [7, 3], [8, 6], [16], [4]
    batches = eval_batches(examples, batch_size=2, seq_len=16, pad_id=0)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2, 1]
    ids = torch.cat([b["input_ids"] for b in batches])
    assert ids[0, :14].tolist() == examples[0].input_ids + examples[1].input_ids and (ids[0, 14:] == 0).all()
    assert ids[3].tolist() + ids[4, :4].tolist() == examples[6].input_ids
    docs = torch.cat([b["doc_ids"] for b in batches])
    assert docs[0].tolist() == [0] * 5 + [1] * 9 + [2] * 2  # the padding is a document of its own
    with torch.no_grad():
        total = sum(_token_losses(model, b).sum() for b in batches)
        alone = 0.0
        for e in examples[:6]:
            alone += _token_losses(
                model, {"input_ids": torch.tensor([e.input_ids]), "labels": torch.tensor([e.labels])}
            ).sum()
        cut = examples[6]  # longer than a row: its second row starts afresh
        for s in (0, 16):
            piece = {
                "input_ids": torch.tensor([cut.input_ids[s : s + 16]]),
                "labels": torch.tensor([cut.labels[s : s + 16]]),
            }
            alone += _token_losses(model, piece).sum()
    torch.testing.assert_close(total, alone, rtol=1e-5, atol=1e-4)
    rows = eval_batches(examples, batch_size=4, seq_len=16, pad_id=0, packing=False)
    assert [b["input_ids"].shape[0] for b in rows] == [4, 3] and "doc_ids" not in rows[0]


def test_micro_batches_through_static_buffers_compute_what_fresh_tensors_do():
    from harli_train.train.batch_buffers import BatchBuffers

    loader = DataLoader(
        _examples([5, 9, 7, 3, 8, 6, 11, 4], seed=9), batch_size=2, seq_len=12, pad_id=0, seed=1
    )
    batches = [loader.next_batch() for _ in range(2)]

    def run(buffers):
        m = _model()
        result, _ = _drain(train_step(m, batches, 2, buffers=buffers))
        return result.loss_sum, [p.grad for p in m.lora_parameters()]

    buffers = BatchBuffers("cpu")
    (ref_loss, ref_grads), (loss, grads) = run(None), run(buffers)
    assert buffers.num_buffers == 4  # ids, labels, positions, doc_ids: one each, refilled per micro-batch
    address = buffers.load(batches[0])["doc_ids"].data_ptr()
    assert buffers.load(batches[1])["doc_ids"].data_ptr() == address
    assert torch.equal(loss, ref_loss)
    for g, w in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, w)

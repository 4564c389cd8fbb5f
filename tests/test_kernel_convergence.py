"""The tiny model trained with the Triton kernels (CPU interpreter, fp32) and with the torch reference ops
follows the same loss curve: the kernels change speed, not training."""

import pytest
import torch

from harli_train import kernels
from harli_train.data import ByteTokenizer, DataLoader, load_examples
from harli_train.model import load_model
from harli_train.train.step import train_step

from .test_train import QUICKSTART


def _train(backend: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    model = load_model("tiny", torch.float32, "cpu", seed=1)
    model.add_lora(4, 8.0, 0.0, seed=2)
    opt = torch.optim.AdamW(model.lora_parameters(), lr=3e-3)
    tok = ByteTokenizer()
    examples = load_examples(
        QUICKSTART.parent / "data" / "quickstart.jsonl", "prompt_completion", tok, max_examples=200
    )
    loader = DataLoader(examples, 2, 32, tok.pad_id, seed=0)
    losses = []
    with kernels.use_backend(backend):
        for _ in range(steps):
            gen = train_step(model, [loader.next_batch()], layers_per_microstep=2)
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    result = stop.value
                    break
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(result.loss_sum.item() / result.target_tokens)
    return losses, [p.detach().clone() for p in model.lora_parameters()]


@pytest.mark.slow
def test_loss_curve_with_and_without_kernels_agree():
    steps = 4
    ref_losses, ref_params = _train("torch", steps)
    got_losses, got_params = _train("triton", steps)
    assert ref_losses[-1] < ref_losses[0]
    assert got_losses == pytest.approx(ref_losses, rel=1e-4)
    for got, want in zip(got_params, ref_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)

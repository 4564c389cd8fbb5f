import os

import pytest
import torch

# Triton kernels run in the CPU interpreter; the variable must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run on the CPU; keep torch from oversubscribing the 2 cores CI has.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def one_thread():
    """torch on one thread for the test: co-located runs have two threads of their own (decode and helpers)
    on CI's two cores, and two thread teams on two shared cores thrash; everything there is tiny."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """A small random transformers Llama saved as a local HF directory; returns (path, hf_model)."""
    from .hf_models import save_tiny_llama

    path = tmp_path / "hf_model"
    model = save_tiny_llama(
        path, vocab_size=96, hidden_size=32, intermediate_size=72, max_position_embeddings=128, std=0.02
    )
    return path, model


_DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def pytest_make_parametrize_id(config, val, argname):
    """Readable ids for dtype parameters (fp32, fp16, bf16), so a run can pick them with -k."""
    return _DTYPE_IDS.get(val) if isinstance(val, torch.dtype) else None


@pytest.fixture(scope="session")
def standalone(tmp_path_factory):
    """The small co-location recipe trained alone (no serving): what every co-located run of it under a
    fixed script must equal, bit for bit (its output directory)."""
    from harli_train.train.trainer import Trainer

    from .runtime_support import recipe

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("standalone")
        trainer = Trainer(recipe(out), quiet=True)
        trainer.setup()
        trainer.train()
    finally:
        torch.set_num_threads(before)
    return out

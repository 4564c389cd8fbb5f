"""`harli-train serve --adapter ... --allow-runtime-lora`: a real server on a free port, driven by the `openai`
client and aiohttp: adapters served under their folder names, equal to the engine in-process; vLLM's load
and unload routes, and their refusals (a pickled adapter, a rank above the slots', another model's adapter,
an unknown name) as one clear error each, the server serving on."""

import asyncio
import shutil

import pytest

from harli_train.engine import EngineConfig, SamplingParams
from harli_train.engine.api import build_catalog

from .hf_models import save_tiny_llama
from .lora_adapters import ALL_TARGETS, save_base, save_peft_adapter
from .test_serve import start_server

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
pytestmark = pytest.mark.slow  # a server process: ~15 s
PROMPT = "hello there"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    base = save_base(root / "base")
    alpha = save_peft_adapter(base, root / "alpha", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    beta = save_peft_adapter(base, root / "beta", rank=4, alpha=4, targets=["q_proj", "down_proj"], seed=2)
    args = ["--adapter", str(alpha), "--adapter", str(beta), "--allow-runtime-lora", "--max-loras", "3"]
    proc, url = start_server(root, str(base), "--device", "cpu", *args)
    yield root, base, url
    proc.terminate()
    proc.wait(timeout=60)


def _local(base, adapter, n=8) -> str:
    """The completion the engine gives in-process (greedy, no EOS stop)."""
    catalog = build_catalog(str(base), "cpu", config=EngineConfig(max_model_len=128), adapters=[str(adapter)])
    seq = catalog.engine.add_request(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True), lora_slot=1)
    catalog.engine.run_until_done()
    return catalog.engine.decode_text(seq)


def _complete(client, model):
    done = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return done.choices[0].text


async def _post(url, route, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/{route}", json=body) as resp:
            return resp.status, await resp.text()


def test_adapters_are_served_by_name_and_equal_the_engine(served):
    root, base, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["base", "alpha", "beta"]
    assert models["alpha"].model_extra["parent"] == "base"
    assert _complete(client, "alpha") == _local(base, root / "alpha")
    assert _complete(client, "beta") == _local(base, root / "beta")
    assert _complete(client, "alpha") != _complete(client, "base")
    with pytest.raises(openai.NotFoundError, match="the model 'gamma' does not exist"):
        _complete(client, "gamma")


def test_load_and_unload_at_run_time_with_clear_refusals(served, tmp_path):
    root, base, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    gamma = shutil.copytree(root / "alpha", tmp_path / "gamma")
    status, text = asyncio.run(
        _post(url, "load_lora_adapter", {"lora_name": "gamma", "lora_path": str(gamma)})
    )
    assert (status, text) == (200, "Success: LoRA adapter 'gamma' added successfully.")
    assert [m.id for m in client.models.list().data] == ["base", "alpha", "beta", "gamma"]
    assert _complete(client, "gamma") == _complete(client, "alpha")

    pickled = shutil.copytree(root / "beta", tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    save_peft_adapter(base, tmp_path / "big", rank=32, alpha=32, targets=["q_proj"], seed=3)
    save_tiny_llama(
        tmp_path / "other", vocab_size=264, hidden_size=48, intermediate_size=72, num_hidden_layers=2
    )
    save_peft_adapter(tmp_path / "other", tmp_path / "wrong", rank=4, alpha=4, targets=["q_proj"], seed=4)
    refusals = {
        "pickled": "only safetensors adapters are loaded",
        "big": "rank 32 exceeds the engine's max LoRA rank 16",
        "wrong": "adapter made for another model",
    }
    for name, why in refusals.items():
        body = {"lora_name": name, "lora_path": str(tmp_path / name)}
        status, text = asyncio.run(_post(url, "load_lora_adapter", body))
        assert status == 400 and why in text, (name, text)
    status, text = asyncio.run(
        _post(url, "load_lora_adapter", {"lora_name": "alpha", "lora_path": str(gamma)})
    )
    assert status == 400 and "already served" in text
    status, text = asyncio.run(_post(url, "load_lora_adapter", {"lora_name": "x"}))
    assert status == 400 and "'lora_path' is required" in text

    assert asyncio.run(_post(url, "unload_lora_adapter", {"lora_name": "gamma"}))[0] == 200
    status, text = asyncio.run(_post(url, "unload_lora_adapter", {"lora_name": "gamma"}))
    assert status == 404 and "no loaded adapter is named 'gamma'" in text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "gamma")
    assert _complete(client, "beta") == _local(base, root / "beta")  # still serving

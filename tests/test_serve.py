"""`harli-train serve`: a real server on a free local port, driven by the `openai` client and raw HTTP: the
API surface, streaming, errors that leave the server serving, authentication, metrics, and shutdown."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .hf_models import save_tiny_llama
from .servers import launch

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KEY = "sk-test"


def build_chat_model(path: Path) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template, saved as an HF dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["hello world, how are you?", "add 12+34 = 46", "the cat sat on the mat"], trainer
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    save_tiny_llama(
        path,
        std=0.2,
        vocab_size=len(fast),
        max_position_embeddings=128,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
    )
    fast.save_pretrained(path)  # save_tiny_llama's save_pretrained leaves the tokenizer files as they are
    return path


def start_server(tmp: Path, model: str, *args: str) -> tuple[subprocess.Popen, str]:
    return launch(["serve", "--model", model, "--port", "0", "--out", str(tmp / "out"), *args])


def post(url: str, body, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers)) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model = build_chat_model(tmp / "chat-model")
    proc, url = start_server(tmp, str(model), "--api-key", KEY, "--max-batch", "4")
    yield proc, url, model, tmp
    if proc.poll() is None:
        proc.kill()


@pytest.mark.slow
def test_the_openai_client_gets_completions_chats_and_streams(server):
    _, url, model, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["chat-model"]
    done = client.completions.create(model="chat-model", prompt="hello world", max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chat = client.chat.completions.create(
        model="chat-model",
        messages=[{"role": "user", "content": "how are you?"}],
        max_tokens=5,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model="chat-model",
        messages=[{"role": "user", "content": "how are you?"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # greedy: the same tokens, streamed
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    # Greedy text through the API equals `harli-train generate` for the same prompt.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    gen = subprocess.run(
        [sys.executable, "-m", "harli_train", "generate", "--model", str(model), "--prompt", "hello world",
         "--max-tokens", "6", "--device", "cpu"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert gen.stdout.rstrip("\n") == "hello world" + done.choices[0].text


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    _, url, _, _ = server
    completions, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    ok = {"model": "chat-model", "prompt": "hi", "max_tokens": 2}
    cases = [
        (completions, b"{not json", 400, None),
        (chat, {"model": "chat-model"}, 400, None),
        (completions, {**ok, "prompt": "hello " * 200}, 400, "context_length_exceeded"),
        (completions, {**ok, "max_tokens": 10_000}, 400, None),
        (completions, {**ok, "temperature": 7}, 400, None),
        (completions, {**ok, "n": 2}, 400, None),
        (completions, {**ok, "model": "gpt-4"}, 404, "model_not_found"),
    ]
    for endpoint, body, status, code in cases:
        got, err = post(endpoint, body)
        assert got == status and set(err["error"]) == {"message", "type", "param", "code"}, (body, err)
        assert code is None or err["error"]["code"] == code
    status, err = post(completions, ok, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    status, body = post(completions, ok)
    assert status == 200 and body["choices"][0]["text"] is not None  # still serving
    with urllib.request.urlopen(f"{url}/metrics") as resp:
        text = resp.read().decode()
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+inf]+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert 'harli_errors_total{status="404"} 1' in text and "harli_ttft_seconds_count" in text
    with urllib.request.urlopen(f"{url}/health") as resp:
        assert resp.status == 200


@pytest.mark.slow
def test_loadgen_replays_a_trace_and_measures_at_the_client(server, tmp_path):
    from harli_train.serve.loadgen import run_loadgen

    _, url, _, _ = server
    trace = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.05 * i, "prompt_len": 5 + i, "output_len": 4 + i % 3, "id": str(i)} for i in range(6)
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_loadgen(url, trace, api_key=KEY, tpot_ms=1000.0, out=tmp_path / "client")
    assert summary["model"] == "chat-model" and summary["completed"] == 6 and summary["errors"] == 0
    records = [
        json.loads(x) for x in (tmp_path / "client" / "client_requests.jsonl").read_text().splitlines()
    ]
    for line, rec in zip(lines, sorted(records, key=lambda r: int(r["request_id"])), strict=True):
        assert rec["output_tokens"] == line["output_len"] and rec["prompt_tokens"] == line["prompt_len"]
        assert rec["ttft_ms"] > 0 and len(rec["intervals_ms"]) == line["output_len"] - 1  # every token timed
    assert summary["intervals"] > 0 and summary["violations"] == 0 and summary["tpot_attainment"] == 1.0


@pytest.mark.slow
def test_sigterm_stops_the_server_with_its_records(server):
    proc, url, _, tmp = server
    post(f"{url}/v1/completions", {"model": "chat-model", "prompt": "the cat", "max_tokens": 3})
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert json.loads(out)["requests"] >= 1
    records = (tmp / "out" / "serve" / "requests.jsonl").read_text().splitlines()
    assert records and all("ttft_ms" in json.loads(r) for r in records)


def test_a_full_queue_is_refused_and_an_aborted_request_frees_its_blocks():
    import asyncio

    import torch

    from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
    from harli_train.model import load_model
    from harli_train.serve.engine_loop import EngineLoop, QueueFull

    model = load_model("tiny", torch.float32, "cpu")
    engine = DecodeEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=128, kernels="torch"))
    loop = EngineLoop(engine, max_queue=1)
    aio = asyncio.new_event_loop()
    first = loop.submit([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "a", aio)
    with pytest.raises(QueueFull):
        loop.submit([1, 2], SamplingParams(max_tokens=2), "b", aio)
    loop.start()

    async def until_tokens():
        event = await first.events.get()
        assert event.tokens
        first.abort()
        while not (await first.events.get()).done:
            pass

    aio.run_until_complete(asyncio.wait_for(until_tokens(), 60))
    loop.stop(grace_s=1.0)
    aio.close()
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    (record,) = engine.metrics.requests
    assert record.finish_reason == "aborted" and 0 < record.output_tokens < 50


def test_a_step_wakes_each_event_loop_once_whatever_its_requests():
    # publish() hands a step's events for every request of a loop over in one call_soon_threadsafe (each is
    # a syscall on the engine's thread); each request still gets its tokens in order, then one final event.
    import asyncio

    import torch

    from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
    from harli_train.model import load_model
    from harli_train.serve.engine_loop import RequestPort

    class CountingLoop(asyncio.SelectorEventLoop):
        wakeups = 0

        def call_soon_threadsafe(self, *args, **kwargs):
            self.wakeups += 1
            return super().call_soon_threadsafe(*args, **kwargs)

    model = load_model("tiny", torch.float32, "cpu")
    engine = DecodeEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=128, kernels="torch"))
    port = RequestPort(engine)
    aio = CountingLoop()
    lengths = (3, 5, 8)
    handles = [
        port.submit([1, 2, 3 + i], SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}", aio)
        for i, n in enumerate(lengths)
    ]
    port.drain()
    publishes = 0
    while port.serving:
        engine.step()
        port.publish()
        publishes += 1
    assert aio.wakeups == publishes  # one per step, not one per request and step

    async def collect(handle):
        tokens = []
        while not (event := await handle.events.get()).done:
            tokens += event.tokens
        return tokens, event.finish_reason

    async def collect_all():
        return await asyncio.gather(*(collect(h) for h in handles))

    got = aio.run_until_complete(collect_all())
    aio.close()
    for (tokens, reason), handle, n in zip(got, handles, lengths, strict=True):
        assert tokens == handle.seq.completion_token_ids and len(tokens) == n and reason == "length"


@pytest.mark.slow
def test_a_colocated_run_serves_http_clients_while_it_trains(tmp_path):
    """`--colocate-with tiny --serve 0`: the openai client gets completions while training advances; SIGTERM
    stops the server, checkpoints the trainer, writes its adapter and exits 0."""
    root = Path(__file__).resolve().parents[1]
    proc, url = launch([str(root / "recipes" / "quickstart.yaml"), "--colocate-with", "tiny", "--serve", "0",
                        "--api-key", KEY, "--quiet", "colocation.rate=0", "train.steps=100000",
                        f"output.dir={tmp_path / 'run'}", "output.checkpoint_every=0"])  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        metrics = tmp_path / "run" / "metrics.jsonl"
        before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        answers = [
            client.completions.create(model="tiny", prompt=f"add {i}+1 =", max_tokens=4) for i in range(3)
        ]
        assert all(a.usage.completion_tokens == 4 or a.choices[0].finish_reason == "stop" for a in answers)
        deadline = time.time() + 60
        while time.time() < deadline and len(metrics.read_text().splitlines()) <= before + 1:
            time.sleep(0.5)
        assert len(metrics.read_text().splitlines()) > before + 1, "training advanced while serving"
        # /metrics carries the trainer's live figures beside the server's own (published every 0.5 s).
        req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        deadline, gauges = time.time() + 30, {}
        while time.time() < deadline and float(gauges.get("harli_train_step", 0)) == 0:
            time.sleep(0.2)
            with urllib.request.urlopen(req) as resp:
                gauges = dict(
                    line.split(" ", 1)
                    for line in resp.read().decode().splitlines()
                    if line and line[0] != "#"
                )
        assert float(gauges["harli_train_step"]) > 0 and float(gauges["harli_trainer_tokens_per_s"]) > 0
        assert float(gauges["harli_total_sms"]) > 0 and float(gauges["harli_token_intervals"]) > 0
        assert "harli_objective_violations" in gauges and "harli_trainer_sms" in gauges
        assert float(gauges['harli_requests_total{kind="completion",state="finished"}']) >= 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads(out)
    assert summary["serving"]["requests"] >= 3 and summary["trainer"]["steps"] > 0
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "colocate" / "serve" / "requests.jsonl").is_file()


def test_a_served_engine_is_warmed_up_on_a_gpu_before_clients_reach_it():
    """`harli-train serve` warms the engine up on a GPU (compiles and kernel loads before the port opens); on a
    CPU, whose interpreted kernels compile nothing, it does not."""
    from types import SimpleNamespace

    from harli_train.serve.command import warm_for_serving

    calls = []
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"), warm_up=lambda: calls.append("gpu") or 14)
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"), warm_up=lambda: calls.append("cpu") or 14)
    assert warm_for_serving(gpu) >= 0.0 and warm_for_serving(cpu) == 0.0
    assert calls == ["gpu"]

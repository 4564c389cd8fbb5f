"""Probe: train.cuda_graphs against the eager step, step by step (GPU; the tiny preset, bf16 autocast).

Three steps with an AdamW update after each, on the default stream and on a side stream, with one and with
two micro-batches, with and without the saved-tensor arena: each line is the steps' (summed token loss,
gradient norm); graphed lines must equal the eager one. ``--packed``: two documents a row (the attention's
mask, as the recipes' packed batches have it). (A cast of the adapter's masters cached outside the graphs made replays read freed memory after
the first update: NaN on Llama-3-8B, an illegal address co-located; `tests/test_gpu.py` holds the contract.)

    PYTHONPATH=$PWD python bench/probe_graph_steps.py [--packed]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harli_train.train.batch_buffers import BatchBuffers  # noqa: E402
from harli_train.train.step import train_step  # noqa: E402
from harli_train.train.step_graphs import StepGraphs  # noqa: E402
from tests.test_gpu import graphs_batch, graphs_model  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("probe_graph_steps: CUDA graphs need a GPU")
autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
packed = "--packed" in sys.argv[1:]
for nmb in (1, 2):
    batches = [graphs_batch(i + 1, two_docs=packed) for i in range(nmb)]
    for graphed, arena in ((False, False), (True, False), (True, True)):
        for side in (False, True) if graphed else (False,):
            m, buffers = graphs_model(), BatchBuffers("cuda")
            params = list(m.lora_parameters())
            opt = torch.optim.AdamW(params, lr=2e-2)
            graphs = StepGraphs(params, arena=arena) if graphed else None
            s = torch.cuda.Stream() if side else torch.cuda.current_stream()
            out = []
            with torch.cuda.stream(s):
                for _ in range(3):
                    gen = train_step(m, batches, 1, autocast, buffers=buffers, graphs=graphs)
                    try:
                        while True:
                            next(gen)
                    except StopIteration as stop:
                        r = stop.value
                    torch.cuda.synchronize()
                    ls = r.loss_sum.item()
                    gn = sum(float(p.grad.float().norm()) ** 2 for p in params) ** 0.5
                    out.append((round(ls, 3), round(gn, 5)))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            print(f"mb={nmb} graphs={graphed} arena={arena} side_stream={side}: {out}", flush=True)

"""The optimizer micro-step: clip the adapter's gradients to a global norm, then one fused AdamW update.

`AdapterUpdate` computes what ``torch.nn.utils.clip_grad_norm_`` followed by a fused ``torch.optim.AdamW``
step computes, bit for bit: the same kernels on the same tensors in the same order. What it leaves out is
their per-tensor Python work: both walk the adapter's tensors (448 for Llama-3-8B with seven targets) on every
call. Here the tensor lists are built once, and a call is nine launches: the gradients' norms,
their stack, the total norm, the clip coefficient and its clamp, the clip, the step counts, the update, the
returned norm. With ``graphs`` those launches are one CUDA graph per stream and SM budget (`set_key`: a
graph runs on the SMs of the stream it was captured on), captured at its first call there and replayed after,
with the learning rate read from a device scalar.

Contract: the optimizer has one parameter group, fused, without amsgrad or maximize (`AdapterUpdate.fits`),
its state exists for every parameter (the trainer creates it at set-up) and AdamW updates it in place; the
gradients are the parameters' ``.grad``. The state's tensors are not replaced once the update has run (it
keeps lists of them), and under ``graphs`` neither are the ``.grad`` tensors (`StepGraphs` hands out its
buffers). Global optimizer post-step hooks do not run; the one this package registers, the cast cache of the
masters (`kernels.lora_linear`), is told directly.
"""

from __future__ import annotations

import math

import torch

from harli_train.cuda_capture import capturing
from harli_train.kernels.launch_config import launch_gate
from harli_train.kernels.lora_linear import forget_master_casts
from harli_train.train.shape_graphs import GraphCaptureError, set_key


class AdapterUpdate:
    """``update(lr)``: clip ``optimizer``'s gradients to a global 2-norm of ``max_norm`` (None: no bound),
    then its AdamW step at learning rate ``lr``; returns the norm before clipping (a 0-d tensor on the
    device, not synchronised)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float | None):
        if not self.fits(optimizer):
            raise ValueError(
                "AdapterUpdate takes one fused AdamW parameter group without amsgrad or maximize"
            )
        self.optimizer = optimizer
        self.max_norm = math.inf if max_norm is None else float(max_norm)
        (group,) = optimizer.param_groups
        self.params: list[torch.Tensor] = list(group["params"])
        self._lists: tuple[list[torch.Tensor], ...] | None = None
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def fits(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is one this update computes exactly."""
        groups = optimizer.param_groups
        if not isinstance(optimizer, torch.optim.AdamW) or len(groups) != 1:
            return False
        g = groups[0]
        return bool(g.get("fused")) and not g["amsgrad"] and not g["maximize"]

    def __call__(self, lr: float, graphs: bool = False) -> torch.Tensor:
        """One update; with ``graphs`` (on a GPU) a replay of this stream's graph of it. A capture that
        fails raises `GraphCaptureError` before anything has changed."""
        if graphs and self.params[0].is_cuda:
            norm = self._replay(lr)
        else:
            norm = self._launch(lr)
        forget_master_casts()
        return norm

    # ---- the launches ---------------------------------------------------------------------------------
    def _state_lists(self) -> tuple[list[torch.Tensor], ...]:
        if self._lists is None:
            states = [self.optimizer.state[p] for p in self.params]
            if any(not st for st in states):
                raise RuntimeError(
                    "AdapterUpdate needs the optimizer's state made first (make_optimizer_state)"
                )
            self._lists = (
                [p.detach() for p in self.params],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [st["step"] for st in states],
            )
        return self._lists

    def _launch(self, lr: float | torch.Tensor, norm_out: torch.Tensor | None = None) -> torch.Tensor:
        params, exp_avgs, exp_avg_sqs, steps = self._state_lists()
        grads = [p.grad for p in self.params]
        (group,) = self.optimizer.param_groups
        with torch.no_grad():
            # clip_grad_norm_'s arithmetic (one device, one dtype): per-tensor norms, their norm, the
            # coefficient clamped at 1, every gradient scaled by it.
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
            coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                amsgrad=False,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
            if norm_out is None:
                return total
            norm_out.copy_(total)
            return norm_out

    def _replay(self, lr: float) -> torch.Tensor:
        key = set_key()
        found = self._captured.get(key)
        if found is None:
            found = self._captured[key] = self._capture()
        graph, lr_dev, norm_out = found
        launch_gate()
        lr_dev.fill_(lr)
        graph.replay()
        return norm_out.clone()

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Capture the launches on the current stream (a side stream where that is the legacy default,
        which cannot capture). Nothing runs: the kernels were loaded at the trainer's warm-up."""
        device = self.params[0].device
        lr_dev = torch.zeros((), dtype=torch.float32, device=device)
        norm_out = torch.zeros((), dtype=torch.float32, device=device)
        current = torch.cuda.current_stream()
        stream = current if current.cuda_stream != 0 else torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                stream.wait_stream(current)
                # thread_local: the decode thread goes on with its own CUDA calls meanwhile.
                with capturing(graph, torch.cuda.graph_pool_handle()):
                    self._launch(lr_dev, norm_out)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise GraphCaptureError(
                f"capturing the optimizer step as a CUDA graph failed ({type(err).__name__}: {first})"
            ) from err
        current.wait_stream(stream)
        return graph, lr_dev, norm_out


def make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state (AdamW's: zero moments, step 0) exactly as its first step would, through a
    step at learning rate 0 over zero gradients; the gradients are left unset."""
    groups = optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(groups, lrs, strict=True):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for st in optimizer.state.values():
        st["step"].zero_()  # a tensor in torch's AdamW

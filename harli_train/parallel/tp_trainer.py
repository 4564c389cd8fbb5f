"""The trainer under tensor parallelism: rank 0's trainer leads, every other rank's follows it micro-step by
micro-step over the trainer's own control channel.

Every rank trains its slice of the adapter on the same batches (the same data, seeds and order), so the
ranks' collectives pair up as long as they run the same micro-steps. Rank 0 is driven like any trainer (by
``train()``, or by the co-location feeder on whatever stream and SM budget it picks); before each of its
micro-steps it tells the others to run theirs (with its SM budget, so a follower picks the same rung), and
it forwards what changes the sequence: a chunk rebuilt before its backward, a step abandoned or its generator
closed, the end. ``follow_trainer`` is the other ranks' loop.

Gradients and norms follow ``TPLlamaForCausalLM`` (summed whole factors, a global norm). The adapter and
checkpoints are the single-process ones: rank 0 writes the factors and optimizer moments gathered from
every rank; the others take part in the gathers and write nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from harli_train import kernels
from harli_train.config import RecipeError
from harli_train.parallel.channel import Channel
from harli_train.parallel.group import TPGroups
from harli_train.parallel.tp_model import TPLlamaForCausalLM
from harli_train.train.step import MicroStep
from harli_train.train.trainer import Trainer

NEXT, CLOSE, ABANDON, REBUILD, FINISH, STOP = 1, 2, 3, 4, 5, 9


def _budget() -> int:
    from harli_train.kernels.launch_config import num_sms

    try:
        return num_sms()
    except Exception:  # no device to ask (a CPU): the budget is only a label then
        return 0


class TPTrainer(Trainer):
    """A ``Trainer`` over rank ``tp.rank``'s slice ``model``; rank 0 leads (``tp.is_leader``)."""

    def __init__(self, cfg, model: TPLlamaForCausalLM, tp: TPGroups, quiet: bool = False):
        if cfg.train.cuda_graphs:
            raise RecipeError(
                cfg.source, "train.cuda_graphs", "false under tensor parallelism (not captured yet)", "true"
            )
        self.tp, self.channel = tp, Channel(tp.train_ctl)
        self._recompute: Callable[[int, int], bool] | None = None
        super().__init__(cfg, model=model, quiet=quiet)

    # ---- the adapter in slices -----------------------------------------------------------------------
    lean_update = False  # the clip's norm is global over every rank's slice: `clip_gradients` below

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        self.model.sync_lora_grads()
        return self.model.clip_lora_grads(max_norm)

    def saved_model(self):
        return self.model.full_adapter_view()

    def saved_optimizer(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: not edited
        gathered = dict(state["state"])
        for i, (name, which, _) in enumerate(self.model.lora_factors()):
            moments = dict(gathered.get(i, {}))
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    moments[key] = self.model.gather_factor(name, which, moments[key])
            gathered[i] = moments
        return {**state, "state": gathered}

    def save_checkpoint(self) -> Path:
        if self.tp.is_leader:
            return super().save_checkpoint()
        self.saved_optimizer()  # the gathers, in the order rank 0's save runs them
        self.saved_model()
        return self.out_dir

    # ---- leading and following -----------------------------------------------------------------------
    @property
    def recompute_chunk(self) -> Callable[[int, int], bool]:
        """Asked before each chunk's backward: rank 0 answers (its feeder's rule) and tells the others."""
        if self.tp.is_leader:

            def lead(micro_batch: int, start: int) -> bool:
                answer = bool(self._recompute(micro_batch, start)) if self._recompute is not None else False
                self.channel.send(REBUILD, [int(answer)])
                return answer

            return lead
        return lambda micro_batch, start: bool(self.channel.recv().ints[0])

    @recompute_chunk.setter
    def recompute_chunk(self, fn: Callable[[int, int], bool] | None) -> None:
        self._recompute = fn

    def micro_steps(self) -> Generator[MicroStep, None, None]:
        inner = super().micro_steps()
        if not self.tp.is_leader:
            yield from inner
            return
        try:
            while True:
                self.channel.send(NEXT, [_budget()])
                try:
                    ms = next(inner)
                except StopIteration:
                    return
                yield ms
        except GeneratorExit:
            self.channel.send(CLOSE)
            inner.close()
            raise

    def abandon_step(self) -> None:
        if self.tp.is_leader:
            self.channel.send(ABANDON)
        super().abandon_step()

    def finish(self) -> dict[str, Any]:
        if self.tp.is_leader:
            self.channel.send(FINISH)
            return super().finish()
        # Rank 0's finish: the checkpoint, then the adapter (their gathers, in that order).
        if self.step > 0:
            self.save_checkpoint()
        self.saved_model()
        self.metrics.close()
        return {}

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' ``follow_trainer`` loops."""
        self.channel.send(STOP)


def follow_trainer(trainer: TPTrainer, place: Callable[[int], Any] = lambda sms: None) -> int:
    """Run rank 0's trainer's micro-steps on this rank until it stops; returns how many ran.
    ``place(sms)``: this rank's trainer stream for rank 0's SM budget (None: the current stream)."""
    gen: Generator[MicroStep, None, None] | None = None
    ran = 0
    while True:
        msg = trainer.channel.recv()
        if msg.kind == NEXT:
            gen = gen or trainer.micro_steps()
            sms, stream = msg.ints[0], place(msg.ints[0])
            ctx = (
                torch.cuda.stream(stream)
                if isinstance(stream, torch.cuda.Stream)
                else contextlib.nullcontext()
            )
            with ctx, kernels.sm_budget(sms) if sms > 0 else contextlib.nullcontext():
                try:
                    next(gen)
                    ran += 1
                except StopIteration:
                    gen = None
        elif msg.kind == CLOSE:
            if gen is not None:
                gen.close()
            gen = None
        elif msg.kind == ABANDON:
            trainer.abandon_step()
        elif msg.kind == FINISH:
            trainer.finish()
        elif msg.kind == STOP:
            return ran
        else:
            raise RuntimeError(f"trainer follower: unexpected message kind {msg.kind} from rank 0")

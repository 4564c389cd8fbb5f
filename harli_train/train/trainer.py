"""The LoRA trainer: setup / train / save_checkpoint, with the step cut into yieldable micro-steps."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from harli_train import kernels
from harli_train.adapter import save_adapter
from harli_train.config import RecipeConfig, recipe_to_dict
from harli_train.data.example import DataError
from harli_train.data.loader import DataLoader
from harli_train.data.tokenizer import load_tokenizer
from harli_train.model import (
    LlamaForCausalLM,
    is_preset,
    load_model,
    model_config,
    resolve_dtype,
)
from harli_train.train.adapter_update import AdapterUpdate, make_optimizer_state
from harli_train.train.batch_buffers import BatchBuffers
from harli_train.train.checkpoint import (
    STATE_JSON,
    CheckpointError,
    SaveError,
    describe_os_error,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from harli_train.train.divergence import TrainingDiverged, check_step
from harli_train.train.log_sinks import check_sinks, open_sinks
from harli_train.train.loss_plot import LOSS_PLOT, plot_loss
from harli_train.train.metrics import MetricsLogger, memory_gib
from harli_train.train.run_checks import (
    check_cuda_graphs,
    check_kernels,
    check_seq_len,
    resolve_device,
    run_length,
)
from harli_train.train.run_dir import prepare_run_dir
from harli_train.train.schedule import lr_at
from harli_train.train.shape_graphs import GraphCaptureError
from harli_train.train.signals import held_signals
from harli_train.train.step import MicroStep, StepResult, train_step
from harli_train.train.step_graphs import StepGraphs
from harli_train.train.trainer_state import rng_state, set_rng_state
from harli_train.train.validation import load_run_data

log = logging.getLogger(__name__)
# Whether train.cuda_graphs keeps what the forwards save in the graphs' shared arena (`StepGraphs`), so that
# a backward on another rung reads its forward's saved tensors instead of replaying that forward first.
GRAPHS_ARENA = True


class Trainer:
    """Trains a LoRA adapter as a recipe says.

    `setup()` readies the output directory (`prepare_run_dir`), then loads the model, data and optimizer (and
    a checkpoint when resuming); `micro_steps()` yields after every launched chunk of work until training is
    done, which is how the co-location runtime drives it; `train()` simply drains that generator. Checkpoints
    hold the adapter, optimizer, schedule position, data position and RNG, so a resumed run continues the
    same loss curve.
    """

    def __init__(self, cfg: RecipeConfig, model: LlamaForCausalLM | None = None, quiet: bool = False):
        self.cfg = cfg
        self.out_dir = Path(cfg.output.dir)
        self.model = model
        self.quiet = quiet
        self.step = 0
        self.total_steps = 0
        self.last_loss = float("nan")
        self.interrupted = False
        self.last_eval_loss: float | None = None
        self._record: dict[str, Any] | None = None  # the counted step's metrics, until they are logged
        # Asked before each chunk's backward whether to rebuild the chunk's forward first (co-location: its
        # stream's SMs went to decode); see `train_step`.
        self.recompute_chunk: Callable[[int, int], bool] | None = None
        # Entered around each chunk's forward of an eager step: where the tensors it saves for backward are
        # kept (co-location keeps them in the page pool, whence they can be spilled to host memory); see
        # `train_step`. A step on graphs keeps them in its arena (which the pool may place: `StepGraphs`).
        self.stash_chunk: Callable[[int], contextlib.AbstractContextManager] | None = None
        # The step's CUDA graphs (train.cuda_graphs), made at setup; dropped if a capture fails.
        self.graphs: StepGraphs | None = None

    # ---- setup ---------------------------------------------------------------------------------------
    def setup(self, resume: str | Path | None = None) -> None:
        cfg = self.cfg
        if not is_preset(cfg.model.name) and Path(cfg.model.name).expanduser().is_dir():
            # Recorded absolute (recipe.yaml, the adapter's base_model_name_or_path), so that `harli-train
            # export` and peft find the base from any working directory.
            cfg.model.name = str(Path(cfg.model.name).expanduser().resolve())
        check_seq_len(cfg, self.model.config if self.model is not None else model_config(cfg.model.name))
        self.device = resolve_device(cfg.train.device, cfg.source)
        prepare_run_dir(
            self.out_dir, resuming=resume is not None, overwrite=cfg.output.overwrite, source=cfg.source
        )
        check_kernels(cfg, self.device)
        check_cuda_graphs(cfg)
        check_sinks(cfg.output.tensorboard, cfg.output.wandb, cfg.source)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        torch.manual_seed(cfg.train.seed)
        if self.model is None:
            self.model = load_model(cfg.model.name, self.dtype, self.device, seed=cfg.model.seed)
        model = self.model
        kernels.set_backend(cfg.train.kernels)
        self.tokenizer = load_tokenizer(cfg.model.name, is_preset(cfg.model.name))
        examples, self.validation = load_run_data(cfg, self.tokenizer)
        self.loader = DataLoader(
            examples,
            cfg.train.batch_size,
            cfg.data.seq_len,
            self.tokenizer.pad_id,
            packing=cfg.data.packing,
            shuffle=cfg.data.shuffle,
            seed=cfg.train.seed,
        )
        self.total_steps = run_length(cfg, self.loader.batches_per_epoch)  # before the recipe is written
        model.add_lora(
            cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.targets), seed=cfg.train.seed
        )
        ckpt = find_checkpoint(Path(resume)) if resume is not None else None
        state = self._load_checkpoint(ckpt) if ckpt is not None else None
        model.train()
        self.params = model.lora_parameters()
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.train.lr,
            betas=tuple(cfg.train.betas),
            eps=cfg.train.eps,
            weight_decay=cfg.train.weight_decay,
            fused=self.device.type == "cuda",
        )
        self._update: AdapterUpdate | None = None  # made at the first update, after the state exists
        self.tokens_seen = 0
        self.buffers = BatchBuffers(self.device)
        if cfg.train.cuda_graphs:
            # With the saved-tensor arena (GRAPHS_ARENA): a backward on another set than its forward reads
            # what that forward saved (docs/design.md, "The trainer's step as CUDA graphs").
            self.graphs = StepGraphs(self.params, arena=GRAPHS_ARENA)
        if state is None:
            # Now, not at the first step: co-located, that would allocate a tensor or more per LoRA
            # parameter (~1300 for Llama-3-8B) while decode serves.
            make_optimizer_state(self.optimizer)
        else:
            try:
                self.loader.load_state_dict(state["loader"])
                self.optimizer.load_state_dict(state["optimizer"])
                set_rng_state(state["rng"])
                self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
            except DataError:
                raise  # says itself what changed
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(
                    f"{ckpt / STATE_JSON}: does not fit this run ({type(e).__name__}: {e})"
                ) from None
        _write_recipe(self.out_dir / "recipe.yaml", cfg)
        resume_step = self.step if state is not None else None
        sinks = open_sinks(
            self.out_dir,
            cfg.output.tensorboard,
            cfg.output.wandb,
            recipe_to_dict(cfg),
            resume_step,
            cfg.source,
        )
        self.metrics = MetricsLogger(
            self.out_dir / "metrics.jsonl",
            self.total_steps,
            cfg.train.log_every,
            resume_step=resume_step,
            quiet=self.quiet,
            sinks=sinks,
        )
        n_params = sum(p.numel() for p in self.params)
        log.info(
            "LoRA r=%d on %s: %.2fM trainable parameters; %d steps on %s (%s)",
            cfg.lora.rank,
            ",".join(cfg.lora.targets),
            n_params / 1e6,
            self.total_steps,
            self.device,
            self.dtype,
        )

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Replace the fresh adapter with the checkpoint's; refuse one made with other LoRA settings."""
        expected = {n: (m.rank, m.alpha) for n, m in self.model.lora_modules().items() if m.has_lora}
        state = load_checkpoint(path, self.model)
        found = {n: (m.rank, m.alpha) for n, m in self.model.lora_modules().items() if m.has_lora}
        if found != expected:
            raise CheckpointError(
                f"checkpoint {path} was made with other LoRA settings (rank, alpha or targets) than "
                f"this recipe; resume with the recipe it was trained with "
                f"({path.parent.parent / 'recipe.yaml'})"
            )
        log.info("resuming from %s at step %d", path, state["step"])
        return state

    # ---- training ------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context the trainer's micro-steps run under (none in fp32 or on a CPU)."""
        if self.device.type == "cuda" and self.dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.dtype)
        return contextlib.nullcontext()

    @property
    def step_graphs(self) -> StepGraphs | None:
        """The graphs the next step runs on: the recipe's (train.cuda_graphs), until a capture fails."""
        return self.graphs

    @property
    def eager_stash(self) -> Callable[[int], contextlib.AbstractContextManager] | None:
        """Where an eager step stashes each chunk's saved tensors (``stash_chunk``: the page pool's); None
        while the step runs on graphs, whose arena holds them."""
        return self.stash_chunk if self.graphs is None else None

    def drop_graphs(self, why: BaseException) -> None:
        """Train on without CUDA graphs (their capture failed): logged; the caller redoes the step in flight
        (`abandon_step`). Waits for the device first: queued replays still use the graphs' memory."""
        log.warning("%s; training goes on without train.cuda_graphs", why)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs.clear()  # the arena's slots (in the page pool's stashes, if placed there) go now
        self.graphs = None

    def release_graphs(self) -> None:
        """Give back what the step's graphs hold (their memory pools, the saved-tensor arena) now, whoever
        still refers to this trainer: for a trainer that is replaced (`Colocation.new_trainer`). It trains on
        without graphs if it runs again. Waits for the device first: queued replays still use that memory."""
        if self.graphs is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.graphs = None

    @property
    def rebuilds_itself(self) -> bool:
        """Whether the step rebuilds a chunk whose backward runs elsewhere than its forward by itself (the
        graphs do), so that `recompute_chunk` is never asked."""
        return self.step_graphs is not None

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def micro_steps(self) -> Generator[MicroStep, None, None]:
        """Run the remaining steps, yielding after each micro-step; checkpoints on the recipe's interval."""
        cfg = self.cfg.train
        while not self.done:
            self._loader_state = self.loader.state_dict()
            self._rng_state = rng_state()
            t0 = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(cfg.grad_accum)]
            result: StepResult = yield from train_step(
                self.model,
                batches,
                cfg.layers_per_microstep,
                self.autocast,
                self.recompute_chunk,
                self.buffers,
                self.eager_stash,
                self.step_graphs,
            )
            lr = lr_at(self.step, cfg.lr, self.total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
            grad_norm = self.update_adapter(lr)
            self.optimizer.zero_grad(set_to_none=True)
            self._pending_commit = (result, lr, grad_norm, t0)
            yield MicroStep("optim", len(batches) - 1)
            self._commit_step()
            if self.validation is not None and self.validation.due(self.step, self.done):
                self._record["eval_loss"] = self.last_eval_loss = yield from self.validation.run(
                    self.model, self.autocast, self.buffers
                )
            self._log_record()
            every = self.cfg.output.checkpoint_every
            if every and self.step % every == 0 and not self.done:
                self.save_checkpoint()

    def train(self) -> dict[str, Any]:
        """Drain the micro-steps. Ctrl-C or SIGTERM stops after checkpointing the last completed step."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            while True:
                try:
                    for _ in self.micro_steps():
                        pass
                    break
                except GraphCaptureError as err:
                    self.drop_graphs(err)
                    self.abandon_step()  # and redo it without graphs
        except KeyboardInterrupt:
            self.interrupt()
        except TrainingDiverged:
            self.metrics.close()  # nothing of the diverged state is saved: no checkpoint, no adapter
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.finish()

    def update_adapter(self, lr: float) -> torch.Tensor:
        """The optimizer micro-step's work: clip the gradients (``train.clip_grad_norm``), then AdamW at
        ``lr``; returns the norm before clipping. On a GPU through `AdapterUpdate` (the same arithmetic in
        a few launches; one graph replay under ``train.cuda_graphs``), else through torch's own."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # what a checkpoint's optimizer state records
        if self.updates_lean(self.optimizer):
            if self._update is None:
                self._update = AdapterUpdate(self.optimizer, self.cfg.train.clip_grad_norm)
            return self._update(lr, graphs=self.step_graphs is not None)
        grad_norm = self.clip_gradients(self.cfg.train.clip_grad_norm or float("inf"))
        self.optimizer.step()
        return grad_norm

    def updates_lean(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `update_adapter` runs ``optimizer``'s kind of update through `AdapterUpdate` (a fused
        AdamW, fused only on a GPU, whose clip norm is over this process's gradients)."""
        return self.lean_update and AdapterUpdate.fits(optimizer)

    # What a tensor-parallel trainer (harli_train.parallel.tp_trainer) replaces: its adapter is in slices.
    # Whether `updates_lean` may answer yes (a clip norm over this process's gradients alone).
    lean_update = True

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the adapter's gradients to a global norm of at most ``max_norm``; returns the norm before."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def saved_model(self) -> LlamaForCausalLM:
        """The model whose adapter the adapter and checkpoint files hold."""
        return self.model

    def saved_optimizer(self) -> dict[str, Any]:
        """The optimizer state a checkpoint holds."""
        return self.optimizer.state_dict()

    def _commit_step(self) -> None:
        """Count the step whose optimizer update has run; from here on it is kept, never redone. Its metrics
        record waits (for an evaluation's loss) until `_log_record`. A step whose loss or gradient norm is not
        finite raises TrainingDiverged instead (nothing counted)."""
        (result, lr, grad_norm, t0), self._pending_commit = self._pending_commit, None
        loss, grad_norm = result.loss_sum.item() / result.target_tokens, float(grad_norm)
        check_step(self.step + 1, loss, grad_norm, self.out_dir)
        self.step += 1
        self.tokens_seen += result.input_tokens
        self.last_loss = loss
        self._loader_state = None
        if self.device.type == "cuda":
            # The trainer's own stream: a device-wide sync would also wait for a co-located decode step.
            torch.cuda.current_stream(self.device).synchronize()
        dt = time.perf_counter() - t0
        self._record = {
            "step": self.step,
            "loss": self.last_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": result.input_tokens,
            "target_tokens": result.target_tokens,
            "tokens_per_s": result.input_tokens / dt,
            "step_s": dt,
            "memory_gib": memory_gib(self.device),
            "epoch": self.loader.epoch,
            "tokens_seen": self.tokens_seen,
        }

    def _log_record(self) -> None:
        """Write the counted step's metrics record (with `eval_loss` when it was evaluated), once."""
        if self._record is not None:
            self.metrics.log(self._record)
            self._record = None

    def abandon_step(self) -> None:
        """Drop the step in flight (gradients, data position, RNG) so the next `micro_steps()` redoes it.

        A step whose optimizer update already ran is kept instead (counted and logged): its weights have
        moved. An evaluation in flight is dropped (its step is logged without it).
        """
        if getattr(self, "_pending_commit", None) is not None:
            self._commit_step()
        self._log_record()
        self.optimizer.zero_grad(set_to_none=True)
        if getattr(self, "_loader_state", None) is not None:
            self.loader.load_state_dict(self._loader_state)
            set_rng_state(self._rng_state)
            self._loader_state = None

    def interrupt(self) -> None:
        """Stop at a step boundary: abandon the step in flight, so the checkpoint is exact."""
        self.interrupted = True
        self.abandon_step()
        log.warning("interrupted: checkpointing step %d", self.step)

    def finish(self) -> dict[str, Any]:
        """Checkpoint the last completed step and write the final adapter; returns the run's summary.

        SIGINT and SIGTERM arriving meanwhile are logged and dropped: the run is ending anyway. SaveError
        (naming the file and the OS error) when either cannot be written; earlier checkpoints stay.
        """
        try:
            with held_signals("the final checkpoint and adapter", redeliver=False):
                ckpt = self.save_checkpoint() if self.step > 0 else None
                try:
                    adapter_dir = save_adapter(
                        self.saved_model(), self.out_dir / "adapter", base_model=self.cfg.model.name
                    )
                except OSError as err:
                    saved = f"; checkpoint {ckpt} is complete" if ckpt else ""
                    raise SaveError(f"could not save the adapter: {describe_os_error(err)}{saved}") from None
        finally:
            self.metrics.close()
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "loss": self.last_loss,
            "eval_loss": self.last_eval_loss,
            "adapter": str(adapter_dir),
            "checkpoint": str(ckpt) if ckpt else None,
            "loss_plot": self._plot_loss(),
            "interrupted": self.interrupted,
        }

    def _plot_loss(self) -> str | None:
        """RUN_DIR/loss.png from metrics.jsonl; a plot that cannot be written is a warning, not a failed run
        (the adapter and checkpoint are saved by then)."""
        try:
            out = plot_loss(self.out_dir / "metrics.jsonl", self.out_dir / LOSS_PLOT, self.out_dir.name)
        except OSError as err:
            log.warning("could not write the loss plot: %s", describe_os_error(err))
            return None
        return str(out) if out else None

    def save_checkpoint(self) -> Path:
        """Checkpoint the last completed step (``checkpoint.save_checkpoint``: crash-safe, SaveError)."""
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "optimizer": self.saved_optimizer(),
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "recipe": recipe_to_dict(self.cfg),
        }
        return save_checkpoint(
            self.out_dir,
            self.step,
            self.saved_model(),
            state,
            self.cfg.model.name,
            self.cfg.output.keep_checkpoints,
        )


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _write_recipe(path: Path, cfg: RecipeConfig) -> None:
    import yaml

    path.write_text(yaml.safe_dump(recipe_to_dict(cfg), sort_keys=False))

"""The engine's adapter slots: every served adapter's weights stacked in one buffer per (layer, projection),
the step's rows-by-slot layout, and the add each projection makes.

Slot 0 is the base model (its rows get no delta); slots 1..max_loras hold adapters. An adapter of rank r <=
R sits in its slot's first r rows of A and columns of B, the rest zero, so one kernel config serves every
rank. `meta` is the current step's `LoRAStepMeta` (None: no row of the step runs an adapter, and no
projection does any LoRA work); the runner sets it around a forward, as it sets the attention's metadata.
Three ways to apply it: `gemv` (the decode forward with `kernel` "gemv": the projection's own launches run
the shrink and the expand), `delta` (the decode forward otherwise: an fp32 delta the projection adds
before its epilogue, by the "fused" or "split" kernels) and `add` (the model's own forward, through hooks).

The A stacks of the projections one launch runs (`GROUPS`: q/k/v, o, gate/up, down) share one buffer per
layer, [slices, S, R, K], so that launch reads them as one matrix; with the "gemv" kernel each group also
keeps B transposed, [S, R, W] per layer (the slices' columns side by side as in the launch's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from harli_train.engine.engine_config import LORA_KERNELS
from harli_train.model.config import ModelConfig
from harli_train.model.linear import LoRALinear
from harli_train.model.llama import LORA_TARGETS

if TYPE_CHECKING:
    from harli_train.engine.decode_linear import GemvLoRA


# The projections one decode launch runs, in the launch's column order.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(slots=True)
class LoRAStepMeta:
    """One step's tokens grouped by adapter slot, prepared once and read by every projection: `sorted_ids`
    [T] int32 and `slot_start` [S + 1] int32 (`lora_ops.lora_layout`), `token_slots` [T] int64 (each
    token's slot, for the torch path), `max_rows` the most rows one adapter slot may hold (the kernels'
    grid). For `LoRASlots.delta` every row is in a slot, the base's included (slot_start[S] = T)."""

    sorted_ids: torch.Tensor
    slot_start: torch.Tensor
    token_slots: torch.Tensor | None
    max_rows: int


def _target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.q_size),
        "k_proj": (h, cfg.kv_size),
        "v_proj": (h, cfg.kv_size),
        "o_proj": (cfg.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def module_key(path: str) -> tuple[int, str]:
    """(layer, target) of a projection's module path,
    e.g. 'model.layers.3.self_attn.q_proj' -> (3, 'q_proj')."""
    parts = path.split(".")
    return int(parts[2]), parts[-1]


class LoRASlots:
    """`max_loras` adapter slots of rank <= `max_rank` for a model of `config`, in `dtype` on `device`.

    Costs 2 * R * (in + out) elements per slot, layer and projection. `write` and `copy_from` fill a slot
    (the caller makes sure no step in flight reads it); `add` applies the current step's adapters."""

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool,
        kernel: str = "split",
    ):
        assert kernel in LORA_KERNELS, f"LoRA kernel {kernel!r} is not one of {LORA_KERNELS}"
        self.num_slots, self.max_rank, self.use_triton = max_loras + 1, max_rank, use_triton
        self.kernel = kernel
        self.num_layers, self.dtype, self.device = config.num_layers, dtype, device
        s, r, L = self.num_slots, max_rank, config.num_layers
        self.shapes = _target_shapes(config)
        self.a_groups: dict[tuple[str, ...], torch.Tensor] = {}
        self.bt_groups: dict[tuple[str, ...], torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}  # [L, S, R, K] views into a_groups
        self.bt: dict[str, torch.Tensor] = {}  # [L, S, R, N] views into bt_groups ("gemv" only)
        for group in GROUPS:
            k = self.shapes[group[0]][0]
            self.a_groups[group] = torch.zeros((L, len(group), s, r, k), dtype=dtype, device=device)
            self.a.update((t, self.a_groups[group][:, i]) for i, t in enumerate(group))
            if kernel == "gemv":
                widths = [self.shapes[t][1] for t in group]
                bt = self.bt_groups[group] = torch.zeros((L, s, r, sum(widths)), dtype=dtype, device=device)
                self.bt.update((t, part) for t, part in zip(group, bt.split(widths, dim=3), strict=True))
        self.b = {
            t: torch.zeros((L, s, n, r), dtype=dtype, device=device) for t, (_, n) in self.shapes.items()
        }
        self.scales = torch.zeros(s, dtype=torch.float32, device=device)
        self.ranks = [0] * s  # 0: the slot holds nothing (slot 0: the base)
        self.meta: LoRAStepMeta | None = None
        self._waits: list[torch.cuda.Event] = []
        self._views: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        buffers = (*self.a_groups.values(), *self.bt_groups.values(), *self.b.values())
        return sum(t.numel() * t.element_size() for t in buffers)

    # ---- filling slots ------------------------------------------------------------------------------
    def check_fits(self, slot: int, rank: int) -> None:
        """ValueError unless `slot` is an adapter slot and `rank` fits its buffers."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"adapter slot {slot} is not in 1..{self.num_slots - 1}")
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"an adapter of rank {rank} does not fit slots of rank {self.max_rank}")

    @torch.no_grad()
    def write(
        self, slot: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], rank: int, scale: float
    ) -> None:
        """Put an adapter in `slot`: `pairs` maps module paths to (A [r, in], B [out, r]); projections it
        leaves out get a zero delta. Copies on the current stream."""
        self.check_fits(slot, rank)
        for t in LORA_TARGETS:
            self.a[t][:, slot].zero_()
            self.b[t][:, slot].zero_()
            if self.bt:
                self.bt[t][:, slot].zero_()
        for path, (a, b) in pairs.items():
            for dst, src in zip(self._slot_views(slot, path, rank), (a, b, b.t()), strict=False):
                dst.copy_(src)
        self.scales[slot] = scale
        self.ranks[slot] = rank

    @torch.no_grad()
    def copy_from(self, slot: int, modules: Mapping[str, LoRALinear]) -> None:
        """Copy the adapters attached to `modules` (module path -> a projection carrying A and B, e.g. the
        trainer's fp32 masters) into `slot`, device to device on the current stream. The slot must have been
        `write`-n with the same rank and projections before (their other entries stay zero).

        One foreach copy over views made once per (slot, projection, rank): the live adapter's refresh runs
        on the trainer's launching thread after every optimizer step, where 2 x 224 Python-indexed copies
        (Llama-3-8B, seven targets) cost milliseconds of host time."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for path, m in modules.items():
            if m.has_lora:
                views = self._slot_views(slot, path, m.rank)
                dsts.extend(views)
                srcs += (m.lora_A, m.lora_B, m.lora_B.t())[: len(views)]
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _slot_views(self, slot: int, path: str, rank: int) -> tuple[torch.Tensor, ...]:
        """(A [rank, in], B [out, rank][, B^T [rank, out] with "gemv"]) of projection `path` in `slot`:
        views into the stacked buffers."""
        key = (slot, path, rank)
        views = self._views.get(key)
        if views is None:
            layer, t = module_key(path)
            views = (self.a[t][layer, slot, :rank], self.b[t][layer, slot, :, :rank])
            if self.bt:
                views += (self.bt[t][layer, slot, :rank],)
            self._views[key] = views
        return views

    def clear(self, slot: int) -> None:
        """Mark `slot` empty (its buffers are overwritten by the next `write`)."""
        self.ranks[slot] = 0

    def wait_before_next_step(self, event: torch.cuda.Event | None) -> None:
        """The next step's stream waits for `event` (a slot written on another stream) before it runs."""
        if event is not None:
            self._waits.append(event)

    def take_waits(self) -> list[torch.cuda.Event]:
        waits, self._waits = self._waits, []
        return waits

    # ---- one step -----------------------------------------------------------------------------------
    def prepare(self, token_slots: np.ndarray) -> LoRAStepMeta | None:
        """The metadata of a step whose token t runs on slot `token_slots[t]`; None when all are the base."""
        from harli_train.engine.lora_ops import lora_layout

        slots = np.asarray(token_slots, dtype=np.int64)
        if not slots.any():
            return None
        sorted_ids, slot_start = lora_layout(slots, self.num_slots)
        dev = self.device
        return LoRAStepMeta(
            torch.from_numpy(sorted_ids).to(dev, non_blocking=True),
            torch.from_numpy(slot_start).to(dev, non_blocking=True),
            torch.from_numpy(slots).to(dev, non_blocking=True),
            int(np.diff(slot_start)[1:].max()),
        )

    @contextlib.contextmanager
    def active(self, token_slots: np.ndarray) -> Iterator[None]:
        """Inside, the projections add the deltas of `token_slots`' adapters (nothing when all are 0)."""
        self.meta = self.prepare(token_slots)
        try:
            yield
        finally:
            self.meta = None

    def add(self, y: torch.Tensor | list[torch.Tensor], x: torch.Tensor, layer: int, targets: Sequence[str]):
        """y [T, N] (the projections `targets` of x [T, K] side by side, in that order), or a list of one
        output per target, plus each adapter row's delta: one shrink and one expand launch either way. Returns
        y itself (updated in place) on the Triton path, new tensors on the torch one. No work when the step
        has no adapter row."""
        meta = self.meta
        if meta is None:
            return y
        a = [self.a[t][layer] for t in targets]
        b = [self.b[t][layer] for t in targets]
        joined = isinstance(y, torch.Tensor)
        columns = (
            np.cumsum([0] + [self.shapes[t][1] for t in targets[:-1]]).tolist() if joined else [0] * len(a)
        )
        if self.use_triton:
            from harli_train.engine.lora_ops import lora_add

            return lora_add(y, x, a, b, columns, meta.sorted_ids, meta.slot_start, self.scales, meta.max_rows)
        from harli_train.engine.lora_ops import lora_add_reference

        if joined:
            return lora_add_reference(y, x, a, b, columns, meta.token_slots, self.scales)
        return [
            lora_add_reference(yi, x, [ai], [bi], [0], meta.token_slots, self.scales)
            for yi, ai, bi in zip(y, a, b, strict=True)
        ]

    def gemv(self, layer: int, group: tuple[str, ...]) -> GemvLoRA | None:
        """The step's LoRA of `layer`'s projection launch `group` (one of `GROUPS`) for `decode_linear` to
        run in its own launches (kernel "gemv"); None, and no work, when the step has no adapter row."""
        from harli_train.engine.decode_linear import GemvLoRA  # imports triton

        meta = self.meta
        if meta is None:
            return None
        a = self.a_groups[group][layer]
        return GemvLoRA(
            a.view(-1, a.shape[-1]), self.bt_groups[group][layer], self.scales, meta.sorted_ids,
            meta.slot_start, self.max_rank, self.num_slots,
        )  # fmt: skip

    def delta(self, x: torch.Tensor, layer: int, targets: Sequence[str]) -> torch.Tensor | None:
        """The fp32 delta [T, sum N] of the projections `targets` of x [T, K], side by side in that order
        (zeros on the base's rows), for the projection to add before its epilogue; None, and no work, when
        the step has no adapter row. One launch with the "fused" kernel, two with "split"."""
        meta = self.meta
        if meta is None:
            return None
        a = [self.a[t][layer] for t in targets]
        b = [self.b[t][layer] for t in targets]
        if self.use_triton:
            from harli_train.engine.lora_fused import lora_delta_fused
            from harli_train.engine.lora_ops import lora_delta_split

            fn = lora_delta_fused if self.kernel == "fused" else lora_delta_split
            return fn(x, a, b, meta.sorted_ids, meta.slot_start, self.scales, meta.max_rows)
        from harli_train.engine.lora_ops import lora_add_reference

        widths = [self.shapes[t][1] for t in targets]
        zeros = torch.zeros((x.shape[0], sum(widths)), dtype=torch.float32, device=x.device)
        columns = [sum(widths[:i]) for i in range(len(widths))]
        return lora_add_reference(zeros, x, a, b, columns, meta.token_slots, self.scales)

    def install_hooks(self, model: torch.nn.Module) -> list:
        """Forward hooks that add the step's adapter deltas to each projection of `model` (the path that runs
        the model's own forward: prefill, mixed steps, decode without the GEMV kernels);
        returns the handles."""
        handles = []
        for path, m in model.lora_modules().items():
            layer, target = module_key(path)

            def hook(module, args, out, layer=layer, target=target):
                if self.meta is None:
                    return None
                x = args[0]
                y = self.add(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), layer, (target,))
                return y.view(out.shape)

            handles.append(m.register_forward_hook(hook))
        return handles


def adapter_slots(seqs, num_tokens: list[int] | None = None) -> np.ndarray:
    """Each sequence's adapter slot (0: the base), repeated for each of its `num_tokens` when given."""
    rows = np.fromiter((s.lora_slot for s in seqs), dtype=np.int64, count=len(seqs))
    return rows if num_tokens is None else np.repeat(rows, num_tokens)

"""The engine's decode-step forward: the model's layers, with its projections run by `decode_linear`.

A decode step is a stream over the weights, so the projections go to the bandwidth-shaped kernel: q/k/v in one
grouped launch, gate/up in one launch with the SwiGLU in its epilogue, o/down/lm_head one launch each, o and
down with the residual add and the next norm fused (batches over MAX_GEMV_ROWS go to cuBLAS). It reads the
model's own weight tensors (nothing is copied or concatenated) and calls the same norm and rope ops as the
model, so its output equals `model(...)` up to the order of fp32 sums. The model's projections carry no
adapter (one would be skipped, so the runner uses it only when none is attached); served adapters come from
the engine's `LoRASlots`, and each projection adds its rows' deltas to its fp32 sums before its epilogue.
With lora_kernel "gemv" the projection's own launches compute them (`LoRASlots.gemv`): the shrink as extra
row tiles of the GEMV, the expand in the split-sum kernel, which then runs even where K is not split; for o
and down (up to EXPAND_IN_NORM_ROWS rows) in the residual add and norm after them instead. Where K is not
split for q/k/v or gate/up (batch 1-16 of an 8B model), the norm that makes their input computes the shrink
instead (`rms_norm_shrink`, or the same launch that sums o or down with its expand:
`decode_linear_add_rms_norm_shrink`) and the GEMV adds the expand in its epilogue: every projection then
takes no launch more than the base's. Otherwise each delta is computed
first (`LoRASlots.delta`: one launch a projection with "fused", two with "split") and handed to the
projection as an addend. Past the GEMV's rows (mixed steps with a prefill chunk), cuBLAS computes the
projection and the deltas are added into its outputs in place (`LoRAAdds`). A step without adapter rows
runs exactly the base path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harli_train import kernels
from harli_train.engine.decode_linear import (
    GemvLoRA,
    decode_linear,
    decode_linear_add_rms_norm,
    decode_linear_add_rms_norm_shrink,
    expands_in_epilogue,
)
from harli_train.engine.decode_norm_shrink import reserve_row_counters, rms_norm_shrink
from harli_train.engine.engine_config import MAX_GEMV_ROWS
from harli_train.engine.lora_slots import GROUPS, LoRASlots
from harli_train.model import LlamaForCausalLM

# From this many rows on, a single square-ish projection (N, K <= 4096: o_proj of an 8B model) goes to
# cuBLAS, whose tiled GEMM beats the split-K GEMV there
# (docs/design.md, "Measured facts behind the defaults").
CUBLAS_SQUARE_ROWS = 64
QKV, O, GATE_UP, DOWN = GROUPS  # the LoRA targets of each projection launch, in its column order
# Up to this many rows an adapter step's norms compute the shrink of the q/k/v and gate/up projections after
# them (`rms_norm_shrink`), where those run without split-K. Each of a norm's programs re-reads the row, so
# past a few rows a shrink in the GEMV's own launch costs less. 0: never.
SHRINK_AHEAD_ROWS = 16


def _use_gemv(x: torch.Tensor, weights: tuple[torch.Tensor, ...], lora: bool = False) -> bool:
    # Past MAX_GEMV_ROWS rows a step is no longer a pure weight stream: cuBLAS's tiled GEMM takes over. A
    # square projection at CUBLAS_SQUARE_ROWS rows stays on the GEMV when it carries the step's LoRA
    # (`lora`): cuBLAS would need the delta computed apart (two launches and the addend's casts), which costs
    # more than the GEMM saves (docs/design.md, "Measured facts behind the defaults").
    m, k = x.shape
    square = len(weights) == 1 and k <= 4096 and weights[0].shape[0] <= 4096
    return m <= MAX_GEMV_ROWS and not (square and m >= CUBLAS_SQUARE_ROWS and not lora)


@dataclass(frozen=True, slots=True)
class LoRAAdds:
    """A projection's adapter deltas added into its cuBLAS outputs in place (`LoRASlots.add`: one shrink and
    one expand launch for all its outputs, the fp32 add before the one cast; the base's rows untouched), the
    path of steps past the GEMV's rows. The same values as the fp32 delta added by torch's casts, without a
    [rows, N] fp32 buffer or an elementwise launch (docs/design.md: what those cost a mixed step)."""

    slots: LoRASlots
    layer: int
    group: tuple[str, ...]  # the targets of the projection's weights, in their order

    def __call__(self, x: torch.Tensor, ys: list[torch.Tensor], joined: torch.Tensor | None) -> list:
        """`ys` (one output per weight) with their deltas, or, when `joined` is given (the outputs side by
        side in one tensor), `joined` with all of them; one pair of launches either way."""
        if joined is not None:
            return [self.slots.add(joined, x, self.layer, self.group)]
        return list(self.slots.add(list(ys), x, self.layer, self.group))


def _project(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,  # fp32 [M, sum N], the GEMV path only: added before the SwiGLU
    lora: GemvLoRA | None = None,  # the GEMV path only (see DecodeForward._adapters)
    adds: LoRAAdds | None = None,  # the cuBLAS path only (see DecodeForward._adapters)
) -> torch.Tensor:
    if _use_gemv(x, weights, lora is not None):
        assert adds is None, "the GEMV path takes its LoRA as `lora` or an `addend`"
        return decode_linear(x, weights, swiglu=swiglu, out=out, addend=addend, lora=lora)
    assert addend is None and lora is None, "the cuBLAS path takes its LoRA as `adds`"
    if swiglu:
        ys = [F.linear(x, w) for w in weights]
        y = kernels.swiglu(*(adds(x, ys, None) if adds is not None else ys))
    else:
        y = _gemms_side_by_side(x, weights)
        if adds is not None:
            (y,) = adds(x, [], y)
    if out is None:
        return y
    return out.copy_(y)


def _gemms_side_by_side(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[x W_1^T, x W_2^T, ...] in one [M, sum N] tensor: each GEMM writes its own columns (cuBLAS takes the
    joined row stride as its leading dimension), so no concatenation copies them afterwards."""
    if len(weights) == 1:
        return F.linear(x, weights[0])
    y = torch.empty((x.shape[0], sum(w.shape[0] for w in weights)), dtype=x.dtype, device=x.device)
    col = 0
    for w in weights:
        torch.mm(x, w.t(), out=y[:, col : col + w.shape[0]])
        col += w.shape[0]
    return y


def _project_add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm,
    addend: torch.Tensor | None = None,
    lora: GemvLoRA | None = None,
    adds: LoRAAdds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # (norm(x W^T (+ delta) + residual), x W^T (+ delta) + residual): with split-K, one kernel after the GEMV.
    if _use_gemv(x, (weight,), lora is not None):
        return decode_linear_add_rms_norm(
            x, weight, residual, norm.weight, norm.eps, addend=addend, lora=lora
        )
    projected = _project(x, (weight,), addend=addend, lora=lora, adds=adds)
    return kernels.add_rms_norm(projected, residual, norm.weight, norm.eps)


class DecodeForward:
    """`forward(ids [B], positions [B], attn) -> final hidden [B, H]`; `logits(hidden, out) -> [B, V]`."""

    def __init__(self, model: LlamaForCausalLM, lora: LoRASlots | None = None):
        if not self.supports(model):
            raise ValueError("DecodeForward serves a base model only: detach the LoRA adapters first")
        self.model, self.lora = model, lora
        if lora is not None:
            reserve_row_counters(model.lm_head.weight.device)  # before any graph is captured
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # q/k/v biases (Qwen2) are a few thousand values: one concatenated copy per layer is cheap.
        self.qkv_bias = [
            torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
            for a in (layer.self_attn for layer in model.model.layers)
        ]

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """True when no projection carries an adapter, only q/k/v may have a bias, and the model is whole
        (a tensor-parallel slice must all-reduce between o/down and the fused add + norm)."""
        if model.tensor_parallel > 1:
            return False
        mods = model.lora_modules()
        no_other_bias = all(
            m.bias is None
            for name, m in mods.items()
            if name.rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj")
        )
        return no_other_bias and not any(m.has_lora for m in mods.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_ctx) -> torch.Tensor:
        """The final normed hidden state [B, H]. Per layer: qkv, attention (rope and the K/V store inside),
        o with the residual add and norm, gate/up with SwiGLU, down with the next add and norm; each
        projection adds the step's adapter delta (when `lora.meta` is set) before its epilogue."""
        model = self.model
        b = input_ids.shape[0]
        cos, sin = model.rope(positions.view(b, 1))
        rope = (cos.view(b, -1), sin.view(b, -1))
        residual = model.embed(input_ids.view(b))
        layers = model.model.layers
        first = layers[0].input_layernorm
        qkv_lora = self._shrink_ahead(residual, self._qkv_weights(0), 0, QKV)
        if qkv_lora is None:
            h = kernels.rms_norm(residual, first.weight, first.eps)
        else:
            h, _, qkv_lora = rms_norm_shrink(residual, None, first.weight, first.eps, qkv_lora)
        for i, (layer, qkv_bias) in enumerate(zip(layers, self.qkv_bias, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w = self._qkv_weights(i)
            qkv_args = {"lora": qkv_lora} if qkv_lora is not None else self._adapters(h, qkv_w, i, QKV)
            qkv = _project(h, qkv_w, **qkv_args)
            if qkv_bias is not None:
                qkv += qkv_bias
            q = qkv[:, : self.q_size].view(b, 1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(b, 1, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(b, 1, self.num_kv_heads, self.head_dim)
            o = attn_ctx.attend(attn.layer_idx, q, k, v, rope=rope).reshape(b, -1)
            o_w, post_norm = attn.o_proj.weight, layer.post_attention_layernorm
            gate_up_w = (mlp.gate_proj.weight, mlp.up_proj.weight)
            gate_up_lora = self._shrink_ahead(o, gate_up_w, i, GATE_UP, swiglu=True)
            h, residual, gate_up_lora = self._project_norm(
                o, o_w, residual, post_norm, self._adapters(o, (o_w,), i, O), gate_up_lora
            )
            gate_up_args = (
                {"lora": gate_up_lora}
                if gate_up_lora is not None
                else self._adapters(h, gate_up_w, i, GATE_UP)
            )
            act = _project(h, gate_up_w, swiglu=True, **gate_up_args)
            last = i + 1 == len(layers)
            norm = model.model.norm if last else layers[i + 1].input_layernorm
            down_w = mlp.down_proj.weight
            qkv_lora = None if last else self._shrink_ahead(act, self._qkv_weights(i + 1), i + 1, QKV)
            h, residual, qkv_lora = self._project_norm(
                act, down_w, residual, norm, self._adapters(act, (down_w,), i, DOWN), qkv_lora
            )
        return h

    __call__ = forward

    def _qkv_weights(self, layer: int) -> tuple[torch.Tensor, ...]:
        attn = self.model.model.layers[layer].self_attn
        return (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)

    def _shrink_ahead(
        self, rows: torch.Tensor, weights: tuple, layer: int, group: tuple[str, ...], swiglu: bool = False
    ) -> GemvLoRA | None:
        """The LoRA of `layer`'s projection launch `group` (input: as many rows as `rows`), for the norm
        before it to compute the shrink of (`rms_norm_shrink`), when that takes a launch off the step: an
        adapter step of up to SHRINK_AHEAD_ROWS rows on the "gemv" kernel whose projection runs the GEMV
        without split-K. None otherwise."""
        slots = self.lora
        if slots is None or slots.meta is None or slots.kernel != "gemv":
            return None
        m = rows.shape[0]
        if (
            m > SHRINK_AHEAD_ROWS
            or not _use_gemv(rows, weights)
            or not expands_in_epilogue(m, weights, swiglu)
        ):
            return None
        return slots.gemv(layer, group)

    @staticmethod
    def _project_norm(
        x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm, adapters: dict, ahead
    ) -> tuple[torch.Tensor, torch.Tensor, GemvLoRA | None]:
        """(norm(x W^T + residual), x W^T + residual, `ahead` with its shrink of the normed rows): the
        projection with the residual add and norm fused (`_project_add_norm`) without `ahead`; with it and
        the projection's own LoRA on the GEMV, the same with the next shrink in the norm's launch
        (`decode_linear_add_rms_norm_shrink`); else the projection, then the add and norm that also shrink
        for the next projection (`rms_norm_shrink`)."""
        if ahead is None:
            return (*_project_add_norm(x, weight, residual, norm, **adapters), None)
        if "lora" in adapters:
            return decode_linear_add_rms_norm_shrink(
                x, weight, residual, norm.weight, norm.eps, lora=adapters["lora"], ahead=ahead
            )
        p = _project(x, (weight,), **adapters)
        return rms_norm_shrink(p, residual, norm.weight, norm.eps, ahead)

    def _adapters(self, x: torch.Tensor, weights: tuple, layer: int, group: tuple[str, ...]) -> dict:
        """The projection's LoRA argument in an adapter step: on the GEMV path `lora` (run in the
        projection's launches) with the "gemv" kernel, else the delta computed first as an `addend`; past
        the GEMV's rows `adds` (added into cuBLAS's outputs in place); {} (no work) in a base step."""
        slots = self.lora
        if slots is None or slots.meta is None:
            return {}
        if not _use_gemv(x, weights, lora=slots.kernel == "gemv"):
            return {"adds": LoRAAdds(slots, layer, group)}
        if slots.kernel == "gemv":
            return {"lora": slots.gemv(layer, group)}
        return {"addend": slots.delta(x, layer, group)}

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, H] -> logits [B, V] (into `out` when given)."""
        return _project(hidden, (self.model.lm_head.weight,), out=out)

"""The model ids an engine serves: its base model, adapters read from PEFT directories, and live adapters
(a co-located trainer's), each on an adapter slot of the engine.

One owner: the thread that owns the engine calls every method but `read` (which only reads files and the
model's shapes, so a request handler may run it off that thread) and `cards`, an immutable snapshot that any
thread may read (it is replaced whole after each change).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harli_train.adapter import WEIGHTS_NAME, AdapterError, AdapterWeights, read_adapter
from harli_train.engine.engine import DecodeEngine
from harli_train.model import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One served model id: the base (`parent` None) or an adapter of it; `root` is where it was read from
    (None for a live adapter), `step` the optimizer step a live adapter reflects."""

    id: str
    parent: str | None = None
    root: str | None = None
    step: int | None = None


def read_for_serving(
    model: LlamaForCausalLM, path: str | Path, max_rank: int | None = None
) -> AdapterWeights:
    """The adapter in PEFT directory `path`, checked against `model` (shapes only) and slots of rank
    `max_rank`; AdapterError naming the problem: not a directory, a pickled adapter (adapter_model.bin is
    never unpickled), a rank above the slots', per-module ranks, modules_to_save, or a module or shape the
    base model does not have (an adapter made for another model)."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter {path}: not a directory (a PEFT adapter directory is expected)")
    if not (path / WEIGHTS_NAME).is_file() and (path / "adapter_model.bin").is_file():
        raise AdapterError(
            f"adapter {path}: only safetensors adapters are loaded ({WEIGHTS_NAME}); adapter_model.bin "
            "is a pickle and is not read: save the adapter with peft's safe_serialization=True"
        )
    weights = read_adapter(model, path)
    for key in ("rank_pattern", "alpha_pattern"):
        if weights.config.get(key):
            raise AdapterError(f"adapter {path}: per-module ranks ({key}) are not supported")
    if weights.config.get("modules_to_save"):
        raise AdapterError(
            f"adapter {path}: modules_to_save {weights.config['modules_to_save']} are not served "
            "(only LoRA on the projections is)"
        )
    if max_rank is not None and weights.rank > max_rank:
        raise AdapterError(
            f"adapter {path}: rank {weights.rank} exceeds the engine's max LoRA rank {max_rank} "
            "(start the server with a larger --max-lora-rank)"
        )
    return weights


class AdapterCatalog:
    """Names to adapter slots for `engine`, whose base model is served as `base_id`."""

    def __init__(self, engine: DecodeEngine, base_id: str) -> None:
        self.engine, self.base_id = engine, base_id
        self._slots: dict[str, int] = {}  # model id -> the slot new requests for it run on
        self._cards: dict[str, ModelCard] = {}
        self._reserved: set[int] = set()  # slots a live adapter manages itself
        self._retired: set[int] = set()  # slots of unloaded adapters whose requests may still run
        self.cards: tuple[ModelCard, ...] = (ModelCard(base_id),)

    @property
    def capacity(self) -> int:
        return 0 if self.engine.lora is None else self.engine.lora.num_slots - 1

    def ids(self) -> list[str]:
        return [c.id for c in self.cards]

    def slot(self, model: str | None) -> int:
        """The slot a new request for `model` runs on (0: the base; None names the base too); KeyError
        when it is not served."""
        if model is None or model == self.base_id:
            return 0
        return self._slots[model]

    def step(self, model: str) -> int | None:
        """The optimizer step a live adapter reflects now (None for the base and static adapters)."""
        card = self._cards.get(model)
        return None if card is None else card.step

    # ---- static adapters ----------------------------------------------------------------------------
    def read(self, path: str | Path) -> AdapterWeights:
        """`read_for_serving` against the served model and this engine's slots."""
        if self.engine.lora is None:
            raise AdapterError("this engine serves no adapters (it was built with max_loras 0)")
        return read_for_serving(self.engine.model, path, self.engine.lora.max_rank)

    def add(self, name: str, weights: AdapterWeights, root: str | None = None) -> int:
        """Serve `weights` as model id `name`; returns its slot. AdapterError when the name is taken or
        every slot is in use."""
        self._check_name(name)
        slot = self._free_slot()
        self.engine.load_lora(slot, weights.pairs, weights.rank, weights.scale)
        self._slots[name] = slot
        self._cards[name] = ModelCard(name, self.base_id, root)
        self._publish()
        return slot

    def remove(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError when it is not served; AdapterError for a live adapter, which
        its run serves to the end). Its running requests finish on it; its slot is reused once they have."""
        if name not in self._slots or name not in self._cards:
            raise KeyError(name)
        if self._cards[name].root is None:
            raise AdapterError(f"'{name}' is the adapter of the run being trained: it is not unloaded")
        self._retired.add(self._slots.pop(name))
        del self._cards[name]
        self._publish()

    # ---- live adapters ------------------------------------------------------------------------------
    def reserve(self, count: int) -> list[int]:
        """`count` free slots that the caller manages (a live adapter's buffers); AdapterError if short."""
        slots = []
        for _ in range(count):
            slots.append(self._free_slot())
            self._reserved.add(slots[-1])
        return slots

    def set_live(self, name: str, slot: int, step: int) -> None:
        """New requests for `name` run on `slot`, which holds the adapter of optimizer step `step`."""
        if name not in self._slots:
            self._check_name(name)
        self._slots[name] = slot
        self._cards[name] = ModelCard(name, self.base_id, None, step)
        self._publish()

    # ---- internals ----------------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if not name or name == self.base_id or name in self._slots:
            what = "the base model's id" if name == self.base_id else "already served" if name else "empty"
            raise AdapterError(f"adapter name {name!r} is {what}: choose another")

    def _free_slot(self) -> int:
        self._retired = {s for s in self._retired if self.engine.slot_busy(s)}
        taken = set(self._slots.values()) | self._reserved | self._retired
        for slot in range(1, self.capacity + 1):
            if slot not in taken:
                return slot
        raise AdapterError(
            f"all {self.capacity} adapter slots are in use (unload one, or start with a larger --max-loras)"
        )

    def _publish(self) -> None:
        self.cards = (ModelCard(self.base_id), *(self._cards[n] for n in sorted(self._cards)))

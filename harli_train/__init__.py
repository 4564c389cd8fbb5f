"""harli-train: LoRA finetuning that harvests the SMs a co-located decode engine leaves idle."""

__version__ = "0.1.0"

"""Models written out for other tools: a run's adapter merged into its base as a Hugging Face directory
(`merged.py`), the adapter's PEFT files alone, and a GGUF file converted to a Hugging Face directory
(`gguf.py`); `hf_dir.py` writes the directories both produce."""


class ExportError(ValueError):
    """An export or conversion the command line asked for that cannot be done as asked (a run without an
    adapter, an output directory that is not empty, a missing optional package): a usage error, exit code 2.
    The message names the file or directory and the problem."""

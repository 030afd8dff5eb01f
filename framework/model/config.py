"""The built-in model's and the memory savers' configuration sections (``model``, ``memory``).

A section is a dataclass of bounded, documented fields (framework/config/fields.py); the whole
configuration assembles them in framework/config/schema.py. Imports no torch: ``--check-config``
reads these without it."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import ActivationCheckpointing, bounded, option


@dataclass
class ModelSection:
    vocab_size: int = bounded(10000, lo=2, resume="changes", was="vocab_size", used_by=("model", "data"))
    """Vocabulary size of the built-in model; text data sets it from the corpus."""
    hidden_size: int = bounded(512, lo=1, resume="changes", was="hidden_size", used_by=("model",))
    """Width of the residual stream (embedding dimension)."""
    num_layers: int = bounded(6, lo=1, resume="changes", was="num_layers", used_by=("model",))
    """Number of transformer blocks."""
    num_heads: int = bounded(8, lo=1, resume="changes", was="num_heads", used_by=("model",))
    """Attention heads per block; must divide hidden_size."""
    dropout: float = bounded(0.1, lo=0.0, hi=0.999, resume="changes", was="dropout", used_by=("model",))
    """Dropout probability in attention, MLP and embeddings."""
    tie_embeddings: bool = option(False, resume="changes", was="tie_embeddings", used_by=("model",))
    """Share the token embedding with the output projection."""
    seq_len: int = bounded(128, lo=1, resume="changes", was="seq_len", used_by=("model", "data"))
    """Tokens per training sequence (context length)."""


@dataclass
class MemorySection:
    activation_checkpointing: ActivationCheckpointing = option("off", resume="changes", was="gradient_checkpointing")
    """Recompute activations in backward: non_reentrant (recommended), reentrant, or offload (CPU-held inputs)."""
    activation_checkpointing_modules: str = option("Block", resume="neutral", was="checkpoint_modules")
    """Comma-separated class names or module-name patterns whose activations are recomputed (for a user's model)."""
    tiled_mlp_chunks: int = bounded(0, lo=0, resume="changes", was="tiled_mlp_chunks")
    """Run the MLP over this many sequence chunks, recomputing each in backward; 0 = off."""
    tiled_mlp_modules: str = option("", resume="changes", was="tiled_mlp_modules")
    """Comma-separated class names or module-name patterns of a user model's SwiGLU MLPs to tile (e.g. LlamaMLP)."""
    cleanup_interval: int = bounded(100, lo=1, resume="neutral", was="cleanup_interval")
    """Run a garbage collection on every rank every this many steps."""
    check_interval: int = bounded(50, lo=1, resume="neutral", was="memory_check_interval")
    """Log memory usage every this many steps."""
    max_gb: float = bounded(16.0, lo=0.0, resume="neutral", was="max_memory_gb")
    """Warn when a rank's memory use exceeds this many GiB."""

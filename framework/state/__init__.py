"""The run's state on disk: checkpoint files, the checkpointer, RNG state, the export, atomic writes."""

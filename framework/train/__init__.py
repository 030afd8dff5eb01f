"""The training step and around it: evaluation, optimizer and schedule, callbacks, the per-step agreement."""

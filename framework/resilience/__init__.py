"""Keeping a run alive and honest: preemption, watchdog, consistency, spikes, stragglers, markers, memory."""

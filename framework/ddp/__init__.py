"""Distributed setup and the DDP wrapper: process group, DDP policy and preflight, comm hooks, compile."""

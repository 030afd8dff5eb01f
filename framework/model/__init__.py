"""The built-in GPT and memory savers: activation checkpointing, CPU offload, Hugging Face hooks, tiled MLPs."""

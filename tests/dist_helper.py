"""The torchrun launch helpers, kept under their old name for the tests' imports; they live in
framework.testing.launch, which bench/ uses too."""

from framework.testing.launch import *  # noqa: F403

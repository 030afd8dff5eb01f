"""What a run reports: logging setup and metrics."""

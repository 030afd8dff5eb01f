"""Data: the built-in datasets, the resumable sampler, batch helpers, the map-style and iterable streams."""

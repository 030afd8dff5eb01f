"""Support for rehearsals and tests: fault injection, launch helpers, a tiny config."""

"""Colocated service: encode, prefill and decode in one process with no transfers (the baseline layout)."""

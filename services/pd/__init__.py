"""Prefill-decode service (PD): prefill and decode in one process, for the E+PD layout."""

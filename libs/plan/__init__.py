"""Capacity planning (`epd plan`): per-stage service times measured from a run's spans drive a
discrete-event simulation (SimPy) of a layout, which predicts TTFT for a request mix and load and
recommends instance counts for an arrival rate and an SLO."""

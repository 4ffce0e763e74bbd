"""Load generation and measurement for EPD stacks (`epd bench`, tests/benchmarks/): request mixes,
arrival processes, HDR-style latency recording, goodput against an SLO, JSON results and plots."""

"""A stand-in service for supervisor tests: says it listens, then exits after argv[1] seconds."""

import sys
import time

print("worker listening on 127.0.0.1:1", flush=True)
time.sleep(float(sys.argv[1]))

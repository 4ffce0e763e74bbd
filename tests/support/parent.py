"""A stand-in service that starts a child of its own and never stops it (as a vLLM engine core is
left behind by a service that was SIGKILLed): prints the child's PID, says it listens, sleeps."""

import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"child {child.pid}", flush=True)
print("worker listening on 127.0.0.1:1", flush=True)
time.sleep(600)

"""Starting and stopping EPD service processes: one process per service, logs to files,
readiness by the service's "listening on" line plus a health check, stop by PID."""

"""gRPC plumbing every EPD server and client shares: server bootstrap (health, reflection,
service info, status mapping, graceful drain), admission control, and peer handshakes."""

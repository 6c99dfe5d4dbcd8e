"""The sidecar process: the gRPC service, the local socket, HTTP (stats, metrics, dashboard), auth."""

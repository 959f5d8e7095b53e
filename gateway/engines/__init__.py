"""The engines side: gRPC clients, the replicas and their health, routing, the KV prefix index."""

"""The front ends: the process and its workers, HTTP routes, the gRPC text API, SSE, web pages."""

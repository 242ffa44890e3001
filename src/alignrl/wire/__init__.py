"""Encodings that cross a process boundary, read by rollout, serve and the placements alike: ZeroMQ frames and the
sockets that carry them, a scored batch as a message, weights as bucket frames or shared memory, and the HTTP
weight body. Never pickle."""

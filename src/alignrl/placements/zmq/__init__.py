"""The ZeroMQ sampler -> trainer pipeline: sampler processes make scored batches and push them to the trainer,
which leases them dataset rows under a staleness bound and publishes its weights back, versioned."""

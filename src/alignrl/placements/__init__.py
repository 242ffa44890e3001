"""Where the pieces of the one RL loop run. Each placement builds the producers (BatchSource) and the weight
sinks of a run from its config: in this process, against HTTP services, as a ZeroMQ sampler -> trainer pipeline
(`zmq/`), or as Ray actor groups (`ray/`). The runner asks a placement for them and never branches on which."""

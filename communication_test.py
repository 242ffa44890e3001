"""The ZeroMQ pipeline's communication test: `python communication_test.py [--host 127.0.0.1] [--data-port 5555]
[--sync-port 5556]`: this process binds the two ports as the trainer does and starts a second one that connects as
the sampler does; a scored batch (with reference log-probs) and the weights make the round trip between them. Prints
one sample, latency and throughput; exit 1 if a port is taken, nothing answers or anything arrives different.
Lives in `alignrl.compat.zmq_comm_test`."""

import sys

from alignrl.compat.zmq_comm_test import comm_test_main

if __name__ == "__main__":
    sys.exit(comm_test_main())

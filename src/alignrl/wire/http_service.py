"""What the HTTP services and their clients agree on beyond the request bodies: the variable holding the bearer
token, the `/health` body, and the header a service names itself by."""

API_KEY_ENV = "ALIGNRL_API_KEY"
HEALTHY = {"status": "healthy"}  # the exact body the seed's `curl .../health` check expects
# /health's header naming the service (generation, reference, reward, retrieval): `alignrl doctor` tells swapped
# service URLs apart by it, where the body stays the seed's
SERVICE_HEADER = "X-Alignrl-Service"

"""The worker among its peers: the process group (rendezvous, regroup after a loss or onto another
world), where the collectives are timed and delayed (comm, the simulated network), what this
worker is doing for the controller's heartbeat, the process's priority."""

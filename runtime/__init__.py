"""zppc's runtime: topology and process groups, collectives, the comm ledger."""

from zppc.runtime.ledger import CommStats, comm_stats, reset_comm_stats
from zppc.runtime.topology import Topology

__all__ = ["CommStats", "Topology", "comm_stats", "reset_comm_stats"]

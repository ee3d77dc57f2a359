"""Everything between daemons: who the members are, the peer client and the routes it calls,
bodies checked as they land, replication, restores from peers, the handoff of a peer connection to
a local trainer, the commit across nodes, and TLS for the peer port."""

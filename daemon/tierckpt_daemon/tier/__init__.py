"""This node's tiers: the shared-memory arena and its leases, the step index and its commit
records, the service that owns them (and their lock), eviction, hydration into memory, and the
uploads to the persistent tier."""

"""Trinity's runtime: the trinity::* custom ops, the host-memory pool, copy streams and events,
and device-memory accounting."""

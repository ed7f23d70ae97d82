"""Tools built on the runtime: the bench, cost-profile plots, backend comparison, parity, concurrency."""

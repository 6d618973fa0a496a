"""The worker path, from message to settle: claim, steps, leases, children, the sweeper."""

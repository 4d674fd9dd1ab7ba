"""The replica runtime: adapters that feed the core from JetStream and serve decisions."""

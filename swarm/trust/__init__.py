"""Trust between strangers.

- identity.py: a peer's identity key file, locked while it runs, and the check that nobody else uses it.
- signing.py: DHT records signed by the peer they name (and refused otherwise); the identity key itself.
- secret.py: private swarms: the shared secret, proofs on stage calls, the DHT's authorizer.
- bans.py: bans of peers that keep sending bad requests (pure).
- hivemind_limits.py: limits on what hivemind reads from the network (installed on import).
"""

"""Trust between strangers: identity keys, signed records, private-swarm secrets, bans of peers that keep sending
bad requests, and limits on what hivemind reads from the network."""

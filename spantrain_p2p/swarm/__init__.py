"""Swarm membership: identities, signed peer records, discovery."""

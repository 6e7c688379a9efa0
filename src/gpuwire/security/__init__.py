"""Transport security: certificates (``gpuwire certs init``) and TLS contexts for nodes,
pools and clients."""

"""Who may call us and what we prove: inbound keys, the TLS key, attestation evidence."""

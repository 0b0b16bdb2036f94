"""Circuit breakers, the failure table, key pools and target order."""

"""CPU sandbox: a tiny locally built model, synthetic verifiable tasks, and the comparison runner."""

"""Plain-torch references: the correctness oracle behind every op (provider kind ``torch``)."""

"""Model architectures (plain torch) and weight loading."""

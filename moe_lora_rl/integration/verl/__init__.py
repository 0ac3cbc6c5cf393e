"""veRL integration: the only package that imports verl."""

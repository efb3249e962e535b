"""GitHub Actions workflows rendered from the registry (``skuforge ci``)."""

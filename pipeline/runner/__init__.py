"""Host state and host-versus-SKU checks."""

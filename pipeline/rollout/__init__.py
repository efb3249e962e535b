"""Shipping engines to devices: release store, TUF signing, waves, health gates, device agent."""

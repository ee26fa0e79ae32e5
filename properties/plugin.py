"""pytest plugin (filled in by the property-suite work)."""

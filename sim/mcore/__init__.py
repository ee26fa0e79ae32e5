"""What the installed megatron-core has, read by feature (never by its version string)."""

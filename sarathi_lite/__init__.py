"""sarathi-lite."""

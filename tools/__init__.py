"""The geir command line and its jobs (demo, bench)."""

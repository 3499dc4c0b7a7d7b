"""The geir command line and its jobs (demo, bench, run, check, show, fuse, example) and ``geir.testing``."""

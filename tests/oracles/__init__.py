"""Independent oracles for the tests: float64 references written from the spec, and numerics helpers."""

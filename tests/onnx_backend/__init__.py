"""ONNX's own backend test suite through geir: the harness, the expectations (which tests fail, and why) and the
script that measures them again."""

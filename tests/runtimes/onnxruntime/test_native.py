"""The native custom-op library: built, loaded and proven, its ABI entries, errors that never crash, the fallback to
the function bodies. Each family's kernels are tested in its folder (tests/<family>/test_*_native.py)."""

from __future__ import annotations

import ctypes

from geir.runtimes.onnxruntime import native_library, native_status
from native_helpers import requires_compiler, run_isolated

pytestmark = requires_compiler


def test_library_is_built_loaded_and_proven():
    path = native_library()
    assert path is not None and path.endswith(".so"), native_status()
    assert native_status() == f"native kernels: {path}"


def test_abi_entries_work_on_the_installed_runtime():
    """CreateStatus/GetErrorMessage/ReleaseStatus round-trip a message; GetBuildInfoString names the build."""
    lib = ctypes.CDLL(native_library())
    buffer = ctypes.create_string_buffer(512)
    assert lib.geir_probe_abi(buffer, 512) == 1
    assert buffer.value.startswith(b"ORT Build Info")


def test_bad_shapes_reaching_a_kernel_raise_not_crash():
    """A model that bypasses geir's checks: the kernel returns an ONNX Runtime error, the process lives on."""
    result = run_isolated("""
        import numpy as np, onnxruntime as ort
        from onnx import helper, TensorProto as T
        from geir.runtimes.onnxruntime import native_library
        node = helper.make_node("InplacePartialRotaryMulGrad", ["x", "c", "c"], ["y"], domain="ai.cann",
                                rotary_mode=1, partial_slice=[0, 8])
        graph = helper.make_graph([node], "bad", [helper.make_tensor_value_info("x", T.FLOAT, [1, 1, 1, 8]),
                                  helper.make_tensor_value_info("c", T.FLOAT, [1, 1, 1, 6])],
                                  [helper.make_tensor_value_info("y", T.FLOAT, [1, 1, 1, 8])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(native_library())
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        try:
            session.run(None, {"x": np.zeros((1, 1, 1, 8), np.float32), "c": np.zeros((1, 1, 1, 6), np.float32)})
        except Exception as exc:
            print("raised:", exc)
        node = helper.make_node("MoeTokenUnpermute", ["p", "s"], ["y"], domain="ai.cann")
        graph = helper.make_graph([node], "bad2", [helper.make_tensor_value_info("p", T.FLOAT, [3, 2]),
                                  helper.make_tensor_value_info("s", T.INT32, [3])],
                                  [helper.make_tensor_value_info("y", T.FLOAT, [3, 2])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        try:
            session.run(None, {"p": np.zeros((3, 2), np.float32), "s": np.array([0, 7, 1], np.int32)})
        except Exception as exc:
            print("raised:", exc)
        print("alive")
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "alive"
    assert "InplacePartialRotaryMulGrad (geir native kernel): cos dim 3 is 6, expected the slice length 8" in result.stdout
    assert "MoeTokenUnpermute (geir native kernel): sorted_indices position 1: expected a value in [0, 3), got 7" \
        in result.stdout


def test_geir_native_0_runs_the_function_bodies():
    result = run_isolated("""
        import numpy as np, geir
        from geir.runtimes.onnxruntime import native_library, native_status
        b = geir.GraphBuilder("g")
        x = b.input("x", "bfloat16", (2, 3, 4, 16))
        c = b.input("c", "bfloat16", (1, 3, 1, 16))
        b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=3, partial_slice=[0, 16]), "y")
        g = b.build()
        rng = np.random.default_rng(0)
        import ml_dtypes
        feeds = {"x": rng.standard_normal((2, 3, 4, 16)).astype(ml_dtypes.bfloat16),
                 "c": rng.uniform(-1, 1, (1, 3, 1, 16)).astype(ml_dtypes.bfloat16)}
        same = np.array_equal(geir.run(g, feeds, runtime="onnxruntime")["y"].view(np.uint16),
                              geir.run(g, feeds)["y"].view(np.uint16))
        print(native_library(), native_status(), same)
    """, env={"GEIR_NATIVE": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None function bodies only (disabled by GEIR_NATIVE=0) True"


def test_unbuildable_library_falls_back_and_says_so_once(tmp_path):
    result = run_isolated("""
        import warnings
        warnings.simplefilter("always")
        import numpy as np, geir
        from geir.runtimes.onnxruntime import native_library, native_status
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = native_library(), native_library()
        print(first, second, len(caught), native_status())
    """, env={"CC": "/bin/false", "GEIR_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("None None 1 function bodies only (RuntimeError: /bin/false failed")

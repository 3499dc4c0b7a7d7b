"""GE's option keys, as geir reads them (issue 27, item 3): what each documented key does in geir.

GE takes a map of strings in ``GEInitialize``, ``Session`` and ``AddGraph``. geir honours the keys that change
what it computes, accepts and reports (``GEGetWarningMsgV2``) the documented keys that have no effect without a
device, and refuses anything else, so that a misspelt key is never silently ignored:

- ``ge.exec.deterministic``: "0" or "1". geir is always deterministic (every kernel sums in a fixed order), so "1"
  is honoured and "0" accepted (a deterministic run is one of the runs "0" allows).
- ``ge.exec.precision_mode`` / ``ge.exec.precision_mode_v2``: geir computes every op in the dtypes of the graph
  (float32 math, one rounding to the output dtype: the contract's numerics), which is ``must_keep_origin_dtype``
  (v2: ``origin``). The values that change dtypes (``force_fp16``, ``allow_mix_precision``, ...) are refused with a
  GraphError naming that mode: geir does not rewrite a graph's precision.
- ``ge.exec.deviceId`` (a number) and ``ge.graphRunMode`` ("0" inference, "1" training) are validated.
- Every other key of GE's list (``KNOWN``) is accepted and reported as having no effect in geir.

Sources: GE's option keys in ``ge_api_types.h`` (CANN's public header, e.g. Ascend/pytorch
third_party/acl/inc/ge/ge_api_types.h @2c360ec2) and the GE option documentation (ge.exec.deterministic,
ge.exec.precision_mode values, ge.exec.precision_mode_v2); issue 27, item 3.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...ir._errors import GraphError

__all__ = ["KNOWN", "PRECISION_MODES", "read_ge_options"]

PRECISION_MODES = ("force_fp32", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype", "allow_mix_precision",
                   "allow_mix_precision_fp16", "allow_mix_precision_bf16", "allow_fp32_to_bf16", "cube_fp16in_fp32out",
                   "force_lowerprecision")
"""The documented values of ``ge.exec.precision_mode``; geir computes as ``must_keep_origin_dtype``."""
PRECISION_MODES_V2 = ("fp16", "origin", "cube_fp16in_fp32out", "mixed_float16", "mixed_bfloat16", "cube_hif8",
                      "mixed_hif8")
"""The documented values of ``ge.exec.precision_mode_v2``; geir computes as ``origin``."""

KNOWN = frozenset("""
ge.graphRunMode ge.deviceType ge.topoSortingMode ge.exec.sessionId ge.exec.deviceId ge.exec.jobId ge.exec.isUseHcom
ge.exec.isUseHvd ge.exec.rankId ge.exec.podName ge.exec.deployMode ge.exec.rankTableFile ge.aicpuFlag ge.soLoadPath
ge.exec.enableDump ge.exec.dumpPath ge.exec.dumpStep ge.exec.dumpMode ge.exec.dumpData ge.exec.dumpLayer
ge.exec.enableDumpDebug ge.exec.dumpDebugMode ge.exec.enableIncreBuild ge.exec.increBuildCachePath
ge.exec.enable_exception_dump ge.exec.enableScopeFusionPasses ge.exec.profilingFpPointOptions
ge.exec.profilingBpPointOptions ge.exec.profilingMode ge.exec.profilingOptions ge.exec.hcclFlag ge.exec.enable_atomic
ge.exec.disableReuseMemory ge.exec.isTailingOptimization ge.exec.dynamicInput ge.exec.dynamicGraphExecuteMode
ge.exec.dataInputsShapeRange ge.exec.enableCopyOutputAddr ge.graphMemoryMaxSize ge.variableMemoryMaxSize
ge.streamNum ge.headStream ge.perfLevel ge.encryptMode ge.ekFile ge.certFile ge.hwKeyFile ge.privateKeyFile
ge.frameworkType ge.calibrationConfFile ge.insertOpFile ge.outputNodeName ge.compressFlag ge.exec.precision_mode
ge.exec.precision_mode_v2 ge.exec.single_op ge.trainFlag ge.runFlag ge.enabledLocalFmkop ge.TBE_plugin_path
ge.DDK_version ge.feFlag ge.streamMaxParallelNum ge.outputDatatype ge.opSelectImplmode ge.optypelistForImplmode
ge.hcomParallel ge.autoTuneMode ge.socVersion ge.engineType ge.aicoreNum ge.l1Fusion ge.bufferOptimize
ge.enableSmallChannel ge.enableCompressWeight ge.fusionSwitchFile ge.saveOriginalModel ge.originalModelFile
ge.INPUT_NODES_SET_FP16 ge.opDebugLevel ge.performance_mode ge.shape_generalized_build_mode ge.exec.modify_mixlist
ge.exec.op_precision_mode ge.exec.tuneDeviceIds ge.dynamicBatchSize ge.fusionTensorSize ge.inputShape
ge.dynamicNodeType ge.dynamicImageSize ge.dynamicDims ge.maxDumpFileNum ge.maxDumpFileSize ge.maxDumpOpNum
ge.enablePrintOpPass ge.debugDir ge.op_compiler_cache_dir ge.op_compiler_cache_mode ge.enableSingleStream
ge.mdl_bank_path ge.display_model_info ge.op_bank_path ge.op_bank_update ge.hcomMultiMode ge.exec.deterministic
ge.deterministicLevel ge.exec.allow_hf32 ge.exec.staticMemoryPolicy ge.exec.atomicCleanPolicy ge.jit_compile
ge.exec.opWaitTimeout ge.exec.opExecuteTimeout ge.exec.variable_acc ge.session_device_id ge.exec.frozenInputIndexes
ge.featureBaseRefreshable ge.constLifecycle ge.exec.inputReuseMemIndexes ge.exec.outputReuseMemIndexes ge.oo.level
""".split())
"""GE's documented option keys (ge_api_types.h and the GE option pages)."""

_HONOURED = {"ge.exec.deterministic", "ge.exec.precision_mode", "ge.exec.precision_mode_v2", "ge.exec.deviceId",
             "ge.graphRunMode"}


def _refuse(what: str, key: str, expected: str, value: str, hint: str = "") -> GraphError:
    return GraphError(f"{what}: option {key!r}: expected {expected}, got {value!r}" + (f"; {hint}" if hint else ""))


def read_ge_options(options: Mapping[str, str], what: str) -> list[str]:
    """Check the GE keys of ``options`` (the ``geir.*`` keys are the caller's); return the reports of the keys
    accepted without effect, for ``GEGetWarningMsgV2``. Raises GraphError for an unknown key or a refused value."""
    reports = []
    for key, value in options.items():
        if key.startswith("geir."):
            continue
        if key not in KNOWN:
            raise _refuse(what, key, "a documented GE option key (ge.exec.deterministic, ge.exec.precision_mode, "
                          "ge.graphRunMode, ...) or one of geir's (geir.runtime, geir.target, geir.raise_errors)",
                          key, "geir refuses an unknown key rather than ignore it")
        if key == "ge.exec.deterministic" and value not in ("0", "1"):
            raise _refuse(what, key, "'0' or '1' (geir is always deterministic: both run deterministically)", value)
        if key == "ge.exec.precision_mode" and value != "must_keep_origin_dtype":
            known = value in PRECISION_MODES
            raise _refuse(what, key, "'must_keep_origin_dtype' (geir computes every op in the graph's own dtypes)",
                          value, "geir does not change a graph's precision; cast in the graph instead" if known else
                          "not a precision mode GE documents (" + ", ".join(PRECISION_MODES) + ")")
        if key == "ge.exec.precision_mode_v2" and value != "origin":
            known = value in PRECISION_MODES_V2
            raise _refuse(what, key, "'origin' (geir computes every op in the graph's own dtypes)", value,
                          "geir does not change a graph's precision; cast in the graph instead" if known else
                          "not a precision mode GE documents (" + ", ".join(PRECISION_MODES_V2) + ")")
        if key == "ge.exec.deviceId" and not value.isdigit():
            raise _refuse(what, key, "a device number >= 0", value)
        if key == "ge.graphRunMode" and value not in ("0", "1"):
            raise _refuse(what, key, "'0' (online inference) or '1' (training)", value)
        if key not in _HONOURED:
            reports.append(f"{what}: GE option {key!r} = {value!r} accepted; it has no effect in geir (no device)")
    return reports

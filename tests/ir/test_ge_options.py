"""GE's option keys in ``geir.ge`` (issue 27, item 3): honoured, refused, or accepted and reported; never ignored.

Sources: GE's option keys in ge_api_types.h (CANN's public header; Ascend/pytorch
third_party/acl/inc/ge/ge_api_types.h @2c360ec2: ge.graphRunMode, ge.exec.deviceId, ge.exec.enableDump,
ge.exec.precision_mode, ge.socVersion, ...) and GE's option documentation (ge.exec.deterministic "0"/"1";
ge.exec.precision_mode force_fp32 / force_fp16 / allow_fp32_to_fp16 / must_keep_origin_dtype / allow_mix_precision).
"""

from __future__ import annotations

import pytest

import geir
from geir import ge
from geir.tools.ge._options import KNOWN, PRECISION_MODES


@pytest.fixture(autouse=True)
def _ge_lifetime():
    yield
    ge.GEFinalize()
    ge.GEGetErrorMsgV2(), ge.GEGetWarningMsgV2()


def test_documented_keys_are_accepted_and_the_inert_ones_reported():
    options = {"ge.exec.deviceId": "0", "ge.graphRunMode": "1", "ge.exec.deterministic": "1",
               "ge.exec.precision_mode": "must_keep_origin_dtype", "ge.socVersion": "Ascend910B1",
               "ge.exec.enableDump": "1", "ge.exec.dumpPath": "/tmp/dump"}
    assert ge.GEInitialize(options) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    reports = ge.GEGetWarningMsgV2().splitlines()
    assert sorted(r.split("'")[1] for r in reports) == ["ge.exec.dumpPath", "ge.exec.enableDump", "ge.socVersion"]
    assert "GEInitialize: GE option 'ge.socVersion' = 'Ascend910B1' accepted; it has no effect in geir (no device)" \
        in reports
    session = ge.Session({"ge.exec.deterministic": "0", "ge.exec.precision_mode_v2": "origin", "geir.runtime": "numpy"})
    assert session.runtime == "numpy" and ge.GEGetWarningMsgV2() == ""      # honoured keys are not reported


@pytest.mark.parametrize("mode", [m for m in PRECISION_MODES if m != "must_keep_origin_dtype"])
def test_precision_modes_that_change_numerics_are_refused(mode):
    assert ge.GEInitialize({"ge.exec.precision_mode": mode}) == ge.FAILED
    message = ge.GEGetErrorMsgV2()
    assert f"GEInitialize: option 'ge.exec.precision_mode': expected 'must_keep_origin_dtype'" in message
    assert f"got '{mode}'; geir does not change a graph's precision" in message
    assert ge.GEInitialize({}) == ge.SUCCESS
    with pytest.raises(geir.GraphError, match=r"option 'ge.exec.precision_mode': expected 'must_keep_origin_dtype'"):
        ge.Session({"ge.exec.precision_mode": mode})


def test_deterministic_takes_0_or_1():
    assert ge.GEInitialize({"ge.exec.deterministic": "2"}) == ge.FAILED
    assert "option 'ge.exec.deterministic': expected '0' or '1'" in ge.GEGetErrorMsgV2()


def test_an_unknown_key_is_an_error_not_ignored():
    assert ge.GEInitialize({"ge.exec.determinstic": "1"}) == ge.FAILED          # misspelt
    assert "option 'ge.exec.determinstic': expected a documented GE option key" in ge.GEGetErrorMsgV2()
    with pytest.raises(geir.GraphError, match="option 'precision_mode': expected a documented GE option key"):
        ge.GEInitialize({"precision_mode": "force_fp16", "geir.raise_errors": "1"})
    assert ge.GEInitialize({}) == ge.SUCCESS
    with pytest.raises(geir.GraphError, match="option 'ge.bogus'"):
        ge.Session({"ge.bogus": "1"})
    assert "option 'ge.bogus'" in ge.GEGetErrorMsgV2()                          # kept for the error channel too
    session = ge.Session({})
    graph = ge.Graph("g")
    assert session.AddGraph(0, graph, {"ge.bogus": "1"}) == ge.FAILED
    assert "Session.AddGraph: option 'ge.bogus'" in ge.GEGetErrorMsgV2()
    with pytest.raises(geir.GraphError, match="Session.AddGraph: option 'ge.bogus'"):
        ge.Session({"geir.raise_errors": "1"}).AddGraph(0, graph, {"ge.bogus": "1"})


def test_the_known_list_holds_the_keys_the_issue_names():
    assert {"ge.exec.deterministic", "ge.exec.precision_mode", "ge.graphRunMode", "ge.exec.deviceId", "ge.socVersion",
            "ge.exec.enableDump"} <= KNOWN
    assert all(k.startswith("ge.") for k in KNOWN)

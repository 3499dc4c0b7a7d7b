"""``geir show --format dot/svg/png`` draws models the way people read them (issue 30): constants folded into their
consumer's box, edges labelled with the type alone and generated symbols abbreviated the same way throughout, our
ops highlighted, nodes clustered by the exporters' module paths, hostile names escaped, a 1,000-node graph drawn in
one linear pass with reference boxes for its long edges, SVG to stdout.

The DOT text is read back by a small reader of DOT's grammar (``tests/dot_reader.py``) rather than by matching the
writer's own formatting."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import geir
from geir.ir._dot import LONG_EDGE, graph_to_dot
from geir.ir._dot_text import OURS_FILL, Symbols, shorten
from geir.tools.cli import main
from geir.tools.model_scopes import SCOPES_KEY, node_scopes, scope_of
from dot_reader import Dot

ROOT = Path(__file__).parents[2]
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


# -- models ---------------------------------------------------------------------------------------------------------
def _exported() -> onnx.ModelProto:
    """What TorchScript's exporter writes, small: '/model/layers.0/mlp/...' names, an initializer, a Constant node,
    a shape symbol ONNX inference generated (unk__7) and one the exporter made (Muly_dim_1)."""
    axes = onnx.numpy_helper.from_array(np.array([2], np.int64))
    nodes = [
        helper.make_node("Constant", [], ["/model/layers.0/mlp/Constant_output_0"], name="/model/layers.0/mlp/Constant",
                         value=axes),
        helper.make_node("MatMul", ["x", "model.layers.0.mlp.up.weight"], ["h"], name="/model/layers.0/mlp/MatMul"),
        helper.make_node("Relu", ["h"], ["r"], name="/model/layers.0/mlp/Relu"),
        helper.make_node("Shape", ["r"], ["shp"], name="/model/Shape"),
        helper.make_node("Reshape", ["r", "shp"], ["rs"], name="/model/Reshape"),
        helper.make_node("Unsqueeze", ["rs", "/model/layers.0/mlp/Constant_output_0"], ["u"],
                         name="/model/layers.0/mlp/Unsqueeze"),
        helper.make_node("Mul", ["rs", "scale"], ["y"], name="/model/norm/Mul"),
    ]
    out = ["unk__7", "Muly_dim_1", 16]
    graph = helper.make_graph(
        nodes, "exported", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out),
         helper.make_tensor_value_info("u", TensorProto.FLOAT, ["unk__7", "Muly_dim_1", 1, 16])],
        initializer=[onnx.numpy_helper.from_array(np.ones((8, 16), np.float32), "model.layers.0.mlp.up.weight"),
                     onnx.numpy_helper.from_array(np.float32(0.125), "scale")],
        value_info=[helper.make_tensor_value_info("rs", TensorProto.FLOAT, out)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def exported() -> geir.Graph:
    return geir.from_onnx(_exported())


def test_constants_are_rows_of_their_consumers_box_not_nodes(exported):
    dot = Dot(exported.to_dot())
    assert set(dot.nodes) == {"in0", "out0", "out1"} | {f"n{i}" for i in range(len(exported.nodes))}
    assert len(exported.constant_values) == 3                    # the initializers and the Constant node's value
    matmul = dot.html_text(dot.node_named("/model/layers.0/mlp/MatMul"))
    assert "up.weight: float32[8,16]" in matmul.splitlines()     # its cluster (model/layers.0/mlp) says the rest
    unsqueeze = dot.html_text(dot.node_named("/model/layers.0/mlp/Unsqueeze"))
    assert "Constant_output_0: int64[1] = [2]" in unsqueeze.splitlines()      # a handful of numbers: their values
    mul = dot.html_text(dot.node_named("/model/norm/Mul"))
    assert "scale: float32[] = 0.125" in mul.splitlines()
    assert not any(tip in ("model.layers.0.mlp.up.weight", "scale") for (_, _, a) in dot.edges for tip in
                   [a["tooltip"]])                               # no edge from a constant
    assert any("3 constants shown in their consumers' boxes" in line for line in dot.caption())


def test_a_constant_the_graph_returns_is_its_own_box():
    b = geir.GraphBuilder("g")
    x = b.input("x", "float32", (2,))
    table = b.constant("table", np.arange(3, dtype=np.float32))
    b.output(b.op("Relu", x), "y")
    b.output(table)
    dot = Dot(b.build().to_dot())
    (box,) = [k for k in dot.nodes if k.startswith("c")]
    assert dot.nodes[box]["label"] == "table\nfloat32[3]" and (box, "out1") in [(s, t) for s, t, _ in dot.edges]


def test_edges_say_the_type_with_generated_symbols_abbreviated_the_same_way_throughout(exported):
    dot = Dot(exported.to_dot())
    labels = {a["tooltip"]: a["label"] for _, _, a in dot.edges}
    assert labels["x"] == "float32[batch,seq,8]"              # the input's symbols keep their names
    assert labels["rs"] == "float32[s0,s1,16]" and labels["y"] == "float32[s0,s1,16]"
    assert labels["u"] == "float32[s0,s1,1,16]" and labels["shp"] == "int64[3]"
    assert sum(1 for s, _, a in dot.edges if a["tooltip"] == "rs") == 2   # each use of rs: the same short label
    assert "s0 = unk__7" in dot.caption() and "s1 = Muly_dim_1" in dot.caption()
    assert "unk__7" not in exported.to_dot().replace("s0 = unk__7", "")   # the long name once, in the legend


def test_symbols_short_names_avoid_kept_ones_and_follow_declared_equalities():
    table = geir.GraphBuilder("g")._graph.symbols
    table.declare_equal("unk__1", "unk__9")
    symbols = Symbols(["s0", "batch"], table.canonical)
    assert [symbols.name(s) for s in ("unk__3", "batch", "unk__1", "unk__9", "unk__3", "s0")] == \
        ["s1", "batch", "s2", "s2", "s1", "s0"]
    assert symbols.legend() == ["s1 = unk__3", "s2 = unk__1"]


def test_our_ops_are_highlighted():
    b = geir.GraphBuilder("g")
    x, cos, sin = b.input("x", "float32", (1, 4, 2, 8)), b.input("cos", "float32", (1, 4, 1, 8)), \
        b.input("sin", "float32", (1, 4, 1, 8))
    b.output(b.op("Relu", b.InplacePartialRotaryMul(x, cos, sin, name="rope")), "y")
    dot = Dot(b.build().to_dot())
    ours, relu = dot.node_named("rope"), next(k for k, t in dot.op_nodes().items() if t.startswith("Relu "))
    assert dot.nodes[ours]["fillcolor"] == OURS_FILL and dot.nodes[ours]["penwidth"] == "2"
    assert "bold" in dot.nodes[ours]["style"] and "ai.cann" in dot.html_text(ours).splitlines()
    assert dot.nodes[relu]["fillcolor"] != OURS_FILL and "penwidth" not in dot.nodes[relu]
    assert "(1 ai.cann)" in dot.graph["label"]


def test_nodes_cluster_by_the_exporters_module_path(exported):
    dot = Dot(exported.to_dot())
    where = {exported.nodes[int(k[1:])].name: dot.where[k] for k in dot.op_nodes()}
    assert where["/model/layers.0/mlp/MatMul"] == ("model", "layers.0/mlp")   # a chain of one-child scopes: one box
    assert where["/model/layers.0/mlp/Unsqueeze"] == ("model", "layers.0/mlp")
    assert where["/model/Shape"] == ("model",)
    assert where["/model/norm/Mul"] == ("model",)               # a scope of one node is no box of its own
    assert dot.where["in0"] == () and dot.where["out0"] == ()


def test_scopes_given_by_node_name_cluster_names_without_prefixes():
    b = geir.GraphBuilder("g")
    x = b.input("x", "float32", (2,))
    y = b.op("Neg", b.op("Relu", x, name="node_relu"), name="node_neg")
    b.output(b.op("Abs", y, name="node_abs"), "y")
    graph = b.build()
    scopes = {"node_relu": ("model", "layers.0", "mlp"), "node_neg": ("model", "layers.0", "mlp"),
              "node_abs": ("model", "norm")}
    dot = Dot(graph_to_dot(graph, scopes))
    assert [dot.where[dot.node_named(n)] for n in ("node_relu", "node_neg", "node_abs")] == \
        [("model", "layers.0/mlp")] * 2 + [("model",)]        # norm's one node joins model's box
    assert all(w == () for w in Dot(graph.to_dot()).where.values())


def test_the_dynamo_exporters_module_scopes_are_read_from_node_metadata():
    def node(name: str, scopes: str | None, inputs=(), outputs=()) -> onnx.NodeProto:
        made = helper.make_node("Relu", list(inputs), list(outputs), name=name)
        if scopes is not None:
            made.metadata_props.add(key=SCOPES_KEY, value=scopes)
        return made

    full = "['', 'model', 'model.layers.0', 'model.layers.0.self_attn', 'view_2']"
    nodes = [node("a", full, ["x"], ["a"]), node("b", "['', 'model', 'layers.0', 'mlp', 'mul_3']", ["a"], ["b"]),
             node("c", "['_empty_nn_module_stack_from_metadata_hook', 'sym_size_int_13']", ["b"], ["c"]),
             node("d", "__import__('os').system('false')", ["c"], ["d"]), node("e", "[1, 2]", ["d"], ["e"]),
             node("split", None, ["e"], ["f"]), node("g", full, ["f"], ["g"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    assert node_scopes(model) == {"a": ("model", "layers.0", "self_attn"), "b": ("model", "layers.0", "mlp"),
                                  "c": (), "g": ("model", "layers.0", "self_attn"),   # no record or a malformed
                                  "split": ("model", "layers.0", "self_attn"),        # one: its consumers' scope
                                  "e": ("model", "layers.0", "self_attn"), "d": ("model", "layers.0", "self_attn")}
    assert scope_of("[" + "'a', " * 5000 + "'b']") is None        # too long to parse
    assert scope_of("{[]: 1}") is None and scope_of("{{1}}") is None  # literal_eval's TypeError: ignored too
    assert node_scopes(helper.make_model(helper.make_graph([node("a", None, ["x"], ["y"])], "g", [], []))) == {}


HOSTILE = 'a"b\\c{d}<b>&amp;\n]; n0 -> n1 [x\r\x07'


def test_hostile_names_are_drawn_as_written_and_never_break_the_dot_text(tmp_path):
    b = geir.GraphBuilder(HOSTILE)
    x = b.input(HOSTILE, "float32", (2, "n"))
    w = b.constant(HOSTILE + "w", np.ones((1,), np.float32))
    y = b.op("Mul", x, w, name=f"/{HOSTILE}/{HOSTILE}/{HOSTILE}")
    b.output(b.op("Relu", y, name=HOSTILE + "<2>"), HOSTILE + "out")
    text = b.build().to_dot()
    dot = Dot(text)                                               # parses: no string or statement broken
    flat = HOSTILE.replace("\r", " ").replace("\x07", " ")
    assert dot.name == flat and dot.nodes["in0"]["label"].startswith(flat + "\n")
    assert set(dot.nodes) == {"in0", "n0", "n1", "out0"}
    assert flat.replace("\n", " ") + "w: float32[1] = [1]" in dot.html_text("n0").splitlines()
    assert dot.where["n0"] == (flat.replace("\n", "\\n"),) or len(dot.where["n0"]) == 0   # one-node scope: no box
    visible = re.sub(r"[\n\r\x07]", " ", shorten(HOSTILE + "<2>", 32))      # a long name: its middle elided
    assert visible in dot.html_text("n1").splitlines() and "{d}<b>&am" in visible
    if shutil.which("dot"):
        result = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=60)
        assert result.returncode == 0 and b"&lt;b&gt;&amp;amp;" in result.stdout, result.stderr


def _layers(count: int, per_layer: int) -> geir.Graph:
    """``count`` layers of ``per_layer`` nodes named '/model/layers.K/...', each starting from a mask computed at
    the top (as a causal mask is), with a weight per layer."""
    b = geir.GraphBuilder("deep")
    x = b.input("x", "float32", ("batch", 16))
    mask = b.op("Sigmoid", x, name="/model/mask")
    h = x
    for k in range(count):
        h = b.op("Mul", h, mask, name=f"/model/layers.{k}/Mul")
        bias = b.constant(f"model.layers.{k}.bias", np.zeros(16, np.float32))
        h = b.op("Add", h, bias, name=f"/model/layers.{k}/Add")
        for j in range(per_layer - 2):
            h = b.op("Relu" if j % 2 else "Neg", h, name=f"/model/layers.{k}/op_{j}")
    b.output(h, "y")
    return b.build()


def test_a_thousand_nodes_draw_in_one_linear_pass_with_reference_boxes_for_long_edges():
    graph = _layers(10, 100)
    assert len(graph.nodes) == 1001
    text = graph.to_dot()
    dot = Dot(text)
    ops = dot.op_nodes()
    assert len(ops) == 1001 and len(text) < 700 * len(ops)       # about a line per node and per edge
    assert sorted({w for w in dot.where.values() if len(w) == 2}) == sorted(("model", f"layers.{k}")
                                                                            for k in range(10))
    refs = [k for k in dot.nodes if k.startswith("r")]
    # the mask feeds every layer: a line to layer 0 (near), a reference box inside each farther layer
    far = [k for k in range(10) if 1 + k * 100 > LONG_EDGE]
    assert sorted(dot.where[r] for r in refs) == [("model", f"layers.{k}") for k in far]
    mask = graph.node("/model/mask").outputs[0].name
    assert all(dot.nodes[r]["label"] == f"{mask}\nfrom Sigmoid" for r in refs)
    into = {(s, t) for s, t, a in dot.edges if a["tooltip"] == mask}
    assert len(into) == 10 and sum(s.startswith("r") for s, _ in into) == len(far)
    assert len(dot.edges) == 2 + 10 * 101                          # one per data dependency, nothing more
    assert len(Dot(_layers(20, 100).to_dot()).edges) == 2 + 20 * 101


def _model(tmp_path: Path) -> Path:
    path = tmp_path / "exported.onnx"
    onnx.save(_exported(), str(path))
    return path


@needs_dot
def test_svg_and_png_go_to_stdout_when_no_file_is_given(tmp_path):
    model = _model(tmp_path)
    run = [sys.executable, "-m", "geir", "show", str(model), "--format"]
    svg = subprocess.run([*run, "svg"], capture_output=True, cwd=ROOT, timeout=300)
    assert svg.returncode == 0, svg.stderr
    assert svg.stdout.lstrip().startswith(b"<?xml") and svg.stdout.rstrip().endswith(b"</svg>")
    assert b"up.weight: float32[8,16]" in svg.stdout and b"s0 = unk__7" in svg.stdout
    png = subprocess.run([*run, "png"], capture_output=True, cwd=ROOT, timeout=300)
    assert png.returncode == 0 and png.stdout.startswith(b"\x89PNG\r\n\x1a\n"), png.stderr
    assert main(["show", str(model), "--format", "svg", "-o", str(tmp_path / "g.svg")]) == 0
    assert (tmp_path / "g.svg").read_bytes().rstrip().endswith(b"</svg>")


def test_png_to_a_terminal_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["show", str(_model(tmp_path)), "--format", "png"]) == 2
    err = capsys.readouterr().err
    assert "--format png is binary: give -o FILE.png, or redirect stdout" in err


def test_the_dot_text_needs_no_graphviz(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["show", str(_model(tmp_path)), "--format", "dot"]) == 0
    dot = Dot(capsys.readouterr().out)
    assert dot.name == "exported" and len(dot.op_nodes()) == 6


def test_characters_xml_forbids_never_reach_the_svg(tmp_path):
    """U+FFFE, U+FFFF and lone surrogates are legal in an ONNX name but not in XML: drawn as spaces, so the SVG
    Graphviz writes stays well-formed."""
    name = "bad\uffffname\ufffe\ud800end"
    b = geir.GraphBuilder(name)
    x = b.input(name, "float32", (2,))
    b.output(b.op("Relu", x, name=name), name + "out")
    text = b.build().to_dot()
    assert all(c not in text for c in "\uffff\ufffe\ud800") and "bad name" in text
    if shutil.which("dot"):
        import xml.dom.minidom
        svg = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=60, check=True)
        xml.dom.minidom.parseString(svg.stdout)                  # raises on a character XML forbids


@needs_dot
def test_a_reader_that_leaves_early_ends_the_picture_not_the_command(tmp_path):
    """``geir show big.onnx --format svg | head -c 100``: as for text, the rest is dropped and the exit status is 0,
    with nothing on stderr (an SVG larger than the pipe's buffer, so the write meets the closed pipe)."""
    path = tmp_path / "deep.onnx"
    geir.save_onnx(_layers(4, 60), str(path))
    with subprocess.Popen([sys.executable, "-m", "geir", "show", str(path), "--format", "svg"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as reader:
        assert reader.stdout.read(100).startswith(b"<?xml")
        reader.stdout.close()
        assert reader.wait(timeout=300) == 0
        assert reader.stderr.read() == b""

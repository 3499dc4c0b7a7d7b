"""The command line explains itself (issue 30, item 5): bare ``geir`` prints the command list, ``geir bench -h`` and
``geir example -h`` list every suite and example from their registries, and ``--dim`` names the model's symbols."""

from __future__ import annotations

import re

import geir
import pytest

from geir.tools import bench
from geir.tools.cli import build_parser, main
from geir.tools.ge_examples import EXAMPLES
from rotary.helpers import ROPE_GRAD, rotary_graph

COMMANDS = ("demo", "bench", "run", "check", "show", "fuse", "example")


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([*args, "-h"])
    assert stopped.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _listed(text: str, title: str) -> dict[str, str]:
    """The entries of a help epilog: name -> its summary, joined over the lines it wraps to."""
    body = text.split(f"\n{title}:\n", 1)[1]
    entries: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        found = re.match(r"  (\S+)(?:\s+(.*))?$", line)
        if found and not line.startswith("    "):
            name = found.group(1)
            entries[name] = found.group(2) or ""
        elif name is not None:
            entries[name] = f"{entries[name]} {line.strip()}".strip()
    return entries


def test_bare_geir_prints_the_command_list_as_geir_h_does(capsys):
    assert main([]) == 0
    bare = capsys.readouterr()
    assert bare.err == "" and bare.out == _help(capsys)
    assert bare.out.startswith("usage: geir ")
    listed = re.findall(r"^    (\w+) ", bare.out, flags=re.MULTILINE)
    assert listed == list(COMMANDS)
    assert bare.out == build_parser().format_help()


def test_bench_help_lists_every_suite_of_the_registry_with_its_summary(capsys, monkeypatch):
    suites = _listed(_help(capsys, "bench"), "suites (default: every one)")
    assert list(suites) == list(bench.SUITES)
    assert {"sfa-cann", "overhead", "torch", "moe_permute"} <= set(suites)       # the ones a hand-kept list missed
    assert all(len(summary) > 20 and summary.endswith(".") for summary in suites.values()), suites
    assert "--quick skips" in suites["sfa-cann"] and "PyTorch" in suites["torch"] and "issue" not in str(suites)

    def tiny(quick: bool) -> list:
        """One new suite, listed without touching the help. Its second sentence is not."""
        return []

    monkeypatch.setitem(bench.SUITES, "tiny", tiny)
    assert _listed(_help(capsys, "bench"), "suites (default: every one)")["tiny"] == \
        "One new suite, listed without touching the help."


def test_example_help_lists_every_example_with_its_summary(capsys):
    examples = _listed(_help(capsys, "example"), "examples (default: all of them)")
    assert list(examples) == list(EXAMPLES)
    assert examples["inplace_partial_rotary_mul"].startswith("CANN's test_geir_inplace_partial_rotary_mul.cpp: mode 1")
    assert examples["moe_token_unpermute_grad"].startswith("MoeTokenUnpermuteGrad with probs")
    assert "``" not in str(examples)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "rope_grad.onnx"
    geir.save_onnx(rotary_graph(ROPE_GRAD, ("B", 4, 2, 16), (1, 4, 1, 8), "bfloat16", "float32", rotary_mode=1,
                                partial_slice=[4, 12]), str(path))
    return str(path)


@pytest.mark.parametrize("dims, message", [
    (["C=2"], "geir run: --dim C: the model's inputs have no symbolic dim 'C' (they have B)"),
    (["B=2", "C=2"], "geir run: --dim C: the model's inputs have no symbolic dim 'C' (they have B)"),
    (["C"], "geir run: --dim 'C': expected NAME=VALUE"),
    (["B="], "geir run: --dim 'B=': expected NAME=VALUE"),
    (["=2"], "geir run: --dim '=2': expected NAME=VALUE"),
    (["B=two"], "geir run: --dim B=two: expected a size >= 0 (decimal digits)"),
    (["B=2=3"], "geir run: --dim B=2=3: expected a size >= 0 (decimal digits)"),
    (["B=2", "B=3"], "geir run: --dim 'B' is given twice"),
])
def test_a_dim_the_model_has_not_or_a_malformed_one_is_one_line_naming_it(model, capsys, dims, message):
    assert main(["run", model, "--random", *[a for d in dims for a in ("--dim", d)]]) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n" and captured.out == ""


def test_a_dim_for_a_model_without_symbols_says_it_has_none(tmp_path, capsys):
    path = tmp_path / "static.onnx"
    geir.save_onnx(rotary_graph(ROPE_GRAD, (2, 4, 2, 16), (1, 4, 1, 8), "float32", "float32", rotary_mode=1,
                                partial_slice=[4, 12]), str(path))
    assert main(["run", str(path), "--random", "--dim", "B=2"]) == 2
    assert capsys.readouterr().err == "geir run: --dim B: the model's inputs have no symbolic dim 'B' (they have none)\n"

"""The native library's op table: each family's C file declares its ops (native/family.h), register.c walks the
tables knowing no family, and what they declare is what the schemas declare: the ops of our domain, every legal
dtype combination over inputs and outputs and nothing else, the optional inputs and outputs, the attributes."""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import geir
from geir.runtimes.onnxruntime import native_library, native_status
from geir.runtimes.onnxruntime._native import CFLAGS, NATIVE, SOURCES, families, families_source, find_compiler
from geir.schemas import InferContext, OpSchema, all_examples, all_schemas, get_schema
from native_helpers import requires_compiler

MAX_IO = 32   # GEIR_MAX_IO: the type buffers geir_op_entry writes into


@dataclass(frozen=True)
class Entry:
    """One registered kernel: an op at one dtype combination."""

    op: str
    inputs: tuple[geir.DType, ...]
    outputs: tuple[geir.DType, ...]
    optional_inputs: int
    optional_outputs: int
    attributes: frozenset[str]


def _table(path: str) -> list[Entry]:
    lib = ctypes.CDLL(path)
    lib.geir_op_entry.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)] + [ctypes.c_void_p] * 5
    lib.geir_op_attributes.restype = ctypes.c_char_p
    lib.geir_registration_error.restype = ctypes.c_char_p
    count = lib.geir_op_count()
    assert count >= 0 and lib.geir_registration_error() is None, lib.geir_registration_error()
    entries = []
    for i in range(count):
        name, n_in, n_out, optional = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        ins, outs = (ctypes.c_int * MAX_IO)(), (ctypes.c_int * MAX_IO)()
        assert lib.geir_op_entry(i, ctypes.byref(name), ins, ctypes.byref(n_in), outs, ctypes.byref(n_out),
                                 ctypes.byref(optional)) == 1
        entries.append(Entry(name.value.decode(), tuple(geir.as_dtype(int(ins[k])) for k in range(n_in.value)),
                             tuple(geir.as_dtype(int(outs[k])) for k in range(n_out.value)), optional.value,
                             lib.geir_op_optional_outputs(i), frozenset(lib.geir_op_attributes(i).decode().split(","))))
    scratch = (ctypes.c_int * MAX_IO)()
    assert lib.geir_op_entry(count, ctypes.byref(ctypes.c_char_p()), scratch, scratch, scratch, scratch, scratch) == 0
    assert lib.geir_op_attributes(count) is None and lib.geir_op_optional_outputs(count) == -1
    return entries


@pytest.fixture(scope="module")
def table() -> list[Entry]:
    path = native_library()
    assert path is not None, native_status()
    return _table(path)


def _ours() -> list[OpSchema]:
    return [s for s in all_schemas() if s.domain == "ai.cann"]


def _output_dtypes(schema: OpSchema, combo: tuple) -> tuple:
    """The output dtypes the schema's inference gives with every input present at ``combo``: shapes from the
    op's example with the most inputs (rank 4 of ones for an input none of them has), its attributes."""
    example = max(all_examples(schema), key=lambda e: len(e.inputs), default=None)
    given = example.inputs if example is not None else {}
    attributes = schema.bind_attributes(example.attributes if example is not None else {}, "probe")
    types = [geir.TensorType(dtype, tuple(given[spec.name].shape) if spec.name in given else (1, 1, 1, 1))
             for spec, dtype in zip(schema.inputs, combo)]
    context = InferContext(schema, "probe", types, attributes)
    schema.infer(context)
    return tuple(t.dtype if t is not None else None for t in context.outputs)


def _mask(specs) -> int:
    return sum(1 << i for i, spec in enumerate(specs) if spec.optional)


@requires_compiler
def test_every_op_of_our_domain_has_native_kernels(table):
    assert {e.op for e in table} == {s.op_type for s in _ours()}


@requires_compiler
def test_the_native_dtype_table_is_the_schemas(table):
    """Both ways, over inputs and outputs: every legal combination of every schema (with the output dtypes its
    inference gives) has a native kernel, and every kernel registered is one of them, once."""
    for schema in _ours():
        rows = [(e.inputs, e.outputs) for e in table if e.op == schema.op_type]
        assert len(rows) == len(set(rows)), (schema.op_type, "a combination registered twice")
        legal = {(tuple(combo), _output_dtypes(schema, combo)) for combo in schema.type_combinations}
        registered = set(rows)
        missing, forbidden = legal - registered, registered - legal
        assert not missing and not forbidden, (schema.op_type, f"legal but not registered: {sorted(map(str, missing))}",
                                               f"registered but not legal: {sorted(map(str, forbidden))}")


@requires_compiler
def test_the_native_kernels_honour_every_attribute_of_their_schema(table):
    """An attribute added to a schema and not read by its C kernel would be ignored silently; one the kernel lists
    that the schema does not declare is a stale table."""
    for entry in table:
        declared = {a.name for a in get_schema(entry.op).attributes}
        assert entry.attributes == declared, (entry.op, f"not honoured: {sorted(declared - entry.attributes)}",
                                              f"not declared: {sorted(entry.attributes - declared)}")


@requires_compiler
def test_the_native_optional_inputs_and_outputs_are_the_schemas(table):
    for entry in table:
        schema = get_schema(entry.op)
        assert (entry.optional_inputs, entry.optional_outputs) == (_mask(schema.inputs), _mask(schema.outputs)), \
            entry.op


# ---- one home per family: the C files declare, register.c walks -------------------------------------------------

def test_each_family_is_one_c_file_and_register_c_names_none():
    """The families are the C files that declare one (no list to edit); register.c includes only family.h and
    names no family and no op."""
    declared = tuple(p.stem for p in SOURCES if re.search(r"^GEIR_FAMILY\(", p.read_text(), re.MULTILINE))
    assert families() == declared and {"rotary", "moe", "sfa"} <= set(declared)
    register = (NATIVE / "register.c").read_text()
    assert re.findall(r'#include\s+"([^"]+)"', register) == ["family.h"]
    for word in [*declared, *(s.op_type for s in _ours())]:
        assert not re.search(rf"\b{word}\b", register, re.IGNORECASE), word
    assert not (NATIVE / "kernels.h").exists()


def test_a_c_file_declares_at_most_one_family_named_after_itself(tmp_path):
    good, other, two = tmp_path / "good.c", tmp_path / "misnamed.c", tmp_path / "two.c"
    good.write_text("static int x;\nGEIR_FAMILY(good, OPS);\n")
    other.write_text("GEIR_FAMILY(good, OPS);\n")
    two.write_text("GEIR_FAMILY(two, A);\nGEIR_FAMILY(two, B);\n")
    assert families((good,)) == ("good",) and families(()) == ()
    for bad in (other, two):
        with pytest.raises(RuntimeError, match=rf"{bad.name} declares GEIR_FAMILY\(.*named after the file"):
            families((bad,))
    assert "geir_family_good" in families_source(("good",)) and "geir_family_count = 0" in families_source(())


FAKE_FAMILY = """
#include "family.h"
static OrtStatus* compute(void* state, OrtKernelContext* ctx) {{ return NULL; }}
static const unsigned char TYPES[][{width}] = {{{rows}}};
static const GeirOpDesc OPS[] = {{
    {{.name = "Fake", .n_in = 1, .n_out = 1, .optional_in = {optional}, .attributes = "a,b", GEIR_COMBOS(TYPES),
     .compute = compute}}}};
GEIR_FAMILY(fake, OPS);
"""


@pytest.fixture(scope="module")
def registration_objects(tmp_path_factory) -> tuple[list[str], Path]:
    """register.c and abi.c compiled once (the small part of the library), for libraries of made-up families."""
    compiler = find_compiler()
    directory = tmp_path_factory.mktemp("registration")
    flags = [f for f in CFLAGS if f != "-shared"]
    objects = []
    for name in ("register.c", "abi.c"):
        obj = directory / f"{name}.o"
        subprocess.run([*compiler, *flags, "-I", str(NATIVE), "-c", "-o", str(obj), str(NATIVE / name)], check=True,
                       capture_output=True, timeout=300)
        objects.append(str(obj))
    return objects, directory


def _fake_library(registration_objects, name: str, rows: int, width: int = 2, optional: int = 0) -> ctypes.CDLL:
    objects, directory = registration_objects
    compiler = find_compiler()
    family, listing = directory / f"{name}.c", directory / f"{name}_families.c"
    family.write_text(FAKE_FAMILY.format(width=width, rows=", ".join(["{1, 1}"] * rows), optional=optional))
    listing.write_text(families_source(("fake",)))
    library = directory / f"{name}.so"
    result = subprocess.run([*compiler, *CFLAGS, "-I", str(NATIVE), "-o", str(library), *objects, str(family),
                             str(listing)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lib = ctypes.CDLL(str(library))
    lib.geir_registration_error.restype = ctypes.c_char_p
    return lib


@requires_compiler
def test_register_c_walks_any_family_table(registration_objects):
    lib = _fake_library(registration_objects, "two_rows", 2)
    assert lib.geir_op_count() == 2 and lib.geir_registration_error() is None
    entries = _table(lib._name)
    assert [(e.op, e.inputs, e.outputs, e.attributes) for e in entries] == [
        ("Fake", (geir.as_dtype("float32"),), (geir.as_dtype("float32"),), frozenset({"a", "b"}))] * 2


@requires_compiler
def test_register_c_holds_as_many_kernels_as_the_tables_declare(registration_objects):
    """The entries are allocated for the tables' count (64 was a fixed array once: the 65th family row failed)."""
    lib = _fake_library(registration_objects, "many_rows", 300)
    assert lib.geir_op_count() == 300 and lib.geir_registration_error() is None
    assert len(_table(lib._name)) == 300


@requires_compiler
@pytest.mark.parametrize("case, rows, width, optional, message", [
    ("too_many", 4097, 2, 0, r"declare 4097 \(op, dtype\) kernels, more than MAX_OPS = 4096 in register.c"),
    ("wide_rows", 3, 3, 0, r"op Fake of family fake has no dtype table, or rows that are not one code per input"),
    ("optional", 1, 2, 2, r"op Fake of family fake marks an input or output optional that it does not have"),
])
def test_a_table_register_c_cannot_hold_is_reported_never_written(registration_objects, case, rows, width, optional,
                                                                   message):
    """Nothing is registered and the reason is what RegisterCustomOps returns (and register_custom_ops_library
    raises, so the function bodies run and geir says why)."""
    lib = _fake_library(registration_objects, case, rows, width, optional)
    assert lib.geir_op_count() == -1
    assert re.search(message, lib.geir_registration_error().decode())
    import onnxruntime as ort
    with pytest.raises(Exception, match=message):
        ort.SessionOptions().register_custom_ops_library(lib._name)

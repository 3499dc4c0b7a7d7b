"""The public ``geir.torch`` functions: a registered op's own body called directly where torch's dispatcher would
call exactly that body, the registered op (``torch.ops.geir.<name>``) everywhere else.

torch's dispatcher costs about 25 us a call (boxing, the Python kernel's re-entry, an aliasing check) before the
op's body runs, more than the tiny-shape kernels themselves. On plain eager calls it does nothing else: with every
tensor a plain CPU tensor, no gradient to record, no mode, transform, tracer or profiler active, it converts the
arguments and calls the body the op was registered with. ``eager_first`` builds, from the op's registered schema,
a function with the op's signature that takes that shortcut only then and calls the op in every other case:

- arguments of exactly the types whose dispatcher conversion it repeats (``bool``, ``int``, ``float`` or ``int``
  for a float, ``str``, ``torch.dtype``, a list or tuple of ``int`` for ``int[]``, ``None`` for an optional);
  anything else (a NumPy scalar, a SymInt, one int for ``int[2]``) takes the op, which converts it;
- each tensor ``type(t) is torch.Tensor`` with a plain CPU tensor's dispatch keys (no subclass, FakeTensor,
  functorch wrapper, functional tensor, meta, nested or sparse tensor, negative or conjugate view), none that
  requires grad while grad mode is on, and an in-place argument a normal (not inference) tensor, whose version
  counter is bumped as the op's ADInplaceOrView kernel bumps it;
- not compiling (``torch.compiler.is_compiling()``, first, so dynamo and export trace the op), no TorchFunctionMode
  (``with torch.device(...)`` included), no TorchDispatchMode (FakeTensorMode, proxy and functional modes), no
  functorch transform (vmap, grad, functionalize), no forward-AD level, no JIT trace, no autograd profiler, and the
  thread's dispatch key include/exclude sets those of plain eager or of inference mode.

None for a required Tensor argument, which torch's dispatcher lets through, is a GraphError naming the op and the
input (before the op is called), not an AttributeError from inside its body.

Omitted arguments get the body's own defaults, as the dispatcher leaves them to the body. The op's output check
(an output may not alias an input) is not repeated: every body returns tensors made from its kernel's fresh
arrays or by torch ops that allocate, which the tests hold on both paths.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

from ._bridge import missing_tensor

__all__ = ["eager_first", "eager_ready", "plain_tensor", "registered_body"]

_C = torch._C
_TENSOR = torch.Tensor
_PLAIN_KEYS = _C._dispatch_keys(torch.empty(0))
with torch.inference_mode():
    _INFERENCE_KEYS = _C._dispatch_keys(torch.empty(0))
    _INFERENCE_TLS = (_C._dispatch_tls_local_include_set(), _C._dispatch_tls_local_exclude_set())
_EAGER_TLS = (_C._dispatch_tls_local_include_set(), _C._dispatch_tls_local_exclude_set())


def eager_ready() -> bool:
    """Whether this thread is in plain eager mode (or inference mode), where the dispatcher adds nothing to a call
    of plain tensors; ``torch.compiler.is_compiling()`` is checked by the caller, first."""
    if (_C._is_torch_function_mode_enabled() or _C._len_torch_dispatch_stack()
            or _C._functorch.peek_interpreter_stack() is not None or _forward_ad._current_level >= 0
            or _C._get_tracing_state() is not None or torch.autograd._profiler_enabled()):
        return False
    include, exclude = _C._dispatch_tls_local_include_set(), _C._dispatch_tls_local_exclude_set()
    return (include == _EAGER_TLS[0] and exclude == _EAGER_TLS[1]) or (
        include == _INFERENCE_TLS[0] and exclude == _INFERENCE_TLS[1])


def plain_tensor(t: Any) -> bool:
    """A plain CPU tensor (normal or inference) that autograd would not record."""
    if type(t) is not _TENSOR:
        return False
    keys = _C._dispatch_keys(t)
    return (keys == _PLAIN_KEYS or keys == _INFERENCE_KEYS) and not (t.requires_grad and _C.is_grad_enabled())


def _plain_mutable(t: Any) -> bool:
    """A plain normal CPU tensor that autograd would not record (its version counter is bumped)."""
    return (type(t) is _TENSOR and _C._dispatch_keys(t) == _PLAIN_KEYS
            and not (t.requires_grad and _C.is_grad_enabled()))


def _ints(value: Any) -> bool:
    return (type(value) is list or type(value) is tuple) and all(type(v) is int for v in value)


_CHECKS = {"Tensor": "_plain({0})", "bool": "type({0}) is bool", "int": "type({0}) is int",
           "float": "(type({0}) is float or type({0}) is int)", "str": "type({0}) is str",
           "ScalarType": "type({0}) is _dtype", "List[int]": "_ints({0})"}
"""Schema type -> the test that an argument needs no conversion the dispatcher makes but the fast path does not."""
_CONVERSIONS = {"float": "float({0})", "List[int]": "({0} if {0} is _d_{0} else list({0}))"}
"""Schema type -> the dispatcher's conversion of an accepted argument (an omitted one keeps the body's default)."""


def registered_body(op: Any) -> Callable[..., Any]:
    """The function a ``torch.library.custom_op`` was made from (what its CPU kernel calls)."""
    body = getattr(op, "_init_fn", None)
    if body is None:
        raise TypeError(f"geir.torch: {op!r} is not a torch.library.custom_op (no registered body)")
    return body


def _argument(arg: Any, name: str, params: Mapping[str, inspect.Parameter],
              free: dict[str, Any]) -> tuple[str, str, str, str]:
    """One schema argument's parts of the generated function: its parameter (with the body's default, put in
    ``free``), its fast-path test, how the body gets it, how the op gets it."""
    a, kind = arg.name, str(arg.real_type)
    optional = kind.startswith("Optional[")
    kind = kind[len("Optional["):-1] if optional else kind
    if kind not in _CHECKS:
        raise TypeError(f"geir.torch: {name}: argument '{a}' of type {arg.real_type} has no fast-path check")
    mutable = arg.alias_info is not None and arg.alias_info.is_write
    check = ("_plain_mutable({0})" if mutable else _CHECKS[kind]).format(a)
    has_default = a in params and params[a].default is not inspect.Parameter.empty
    if has_default:
        free[f"_d_{a}"] = params[a].default
    converted = _CONVERSIONS.get(kind, "{0}").format(a) if has_default or kind != "List[int]" else f"list({a})"
    if optional and converted != a:
        converted = f"(None if {a} is None else {converted})"
    keyword = a in params and params[a].kind is inspect.Parameter.KEYWORD_ONLY
    return (f"{a}=_d_{a}" if has_default else a, f"({a} is None or {check})" if optional else check,
            f"{a}={converted}" if keyword else converted, f"{a}={a}" if arg.kwarg_only else a)


def eager_first(name: str, body: Callable[..., Any], module: str) -> Callable[..., Any]:
    """``torch.ops.geir.<name>``'s signature as a function that calls ``body`` (the op's own body, or one the op's
    registration provably calls with the same arguments) where the dispatcher would add nothing, else the op.

    ``body`` takes the schema's arguments in order (keyword-only ones by keyword where it declares them so);
    the function's defaults are ``body``'s (what the dispatcher leaves an omitted argument to). The function
    carries ``op`` (``torch.ops.geir.<name>``) and ``source`` (its generated code)."""
    op = getattr(torch.ops.geir, name).default
    params = inspect.signature(body).parameters
    free: dict[str, Any] = {"_body": body, "_op": op, "_plain": plain_tensor, "_plain_mutable": _plain_mutable,
                            "_ints": _ints, "_dtype": torch.dtype, "_compiling": torch.compiler.is_compiling,
                            "_ready": eager_ready, "_bump": torch.autograd.graph.increment_version,
                            "_missing": missing_tensor}
    signature, checks, body_args, op_args = [], [], [], []
    for arg in op._schema.arguments:
        if arg.kwarg_only and "*" not in signature:
            signature.append("*")
        parameter, check, body_arg, op_arg = _argument(arg, name, params, free)
        signature.append(parameter)
        checks.append(check)
        body_args.append(body_arg)
        op_args.append(op_arg)
    bumps = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    required = [a.name for a in op._schema.arguments if str(a.real_type) == "Tensor"]
    lines = [f"def _make({', '.join(free)}):",
             f"    def {name}({', '.join(signature)}):",
             f"        if not _compiling() and _ready() and {' and '.join(checks)}:",
             *[f"            _bump({a})" for a in bumps],          # as the op's ADInplaceOrView kernel, first
             f"            return _body({', '.join(body_args)})",
             *[f"        if {a} is None:\n            raise _missing({a!r}, {name!r})" for a in required],
             f"        return _op({', '.join(op_args)})",
             f"    return {name}"]
    source = "\n".join(lines)
    namespace: dict[str, Any] = {"__name__": __name__}   # helpers are closure cells: dynamo reads no fake globals
    exec(compile(source, f"<geir.torch fast path of {name}>", "exec"), namespace)  # noqa: S102
    fn = namespace["_make"](**free)
    fn.__module__, fn.__qualname__, fn.__doc__ = module, name, body.__doc__
    fn.op = getattr(torch.ops.geir, name)
    fn.source = source
    return fn

"""Fusion patterns of the rotary family: rope written with standard ops -> InplacePartialRotaryMul(Grad).

- half (Llama's ``x * cos + rotate_half(x) * sin``, rotate_half = ``cat(-x[..., h:], x[..., :h])`` by Slice or
  Split) -> mode 0;
- interleaved (GPT-J's rotate_every_two: ``stack(-x[..., 1::2], x[..., 0::2], -1)`` flattened, by strided
  Slice, Unsqueeze, Concat and Reshape) -> mode 1;
- partial (a rope on a slice of the head dim, the rest passed through: ``cat(x[..., :s], rope(x[..., s:e]),
  x[..., e:])``, the pieces by Slice or by one Split, MLA's rope part) -> the same op on x with partial_slice [s, e];
- half-width tables (GPT-OSS, DeepSeek-V3's ``rope_interleave``: ``cat(a * c - b * s, b * c + a * s)`` with c, s of
  half the width): a, b the halves of x (Split or Slice) -> mode 0, x's even and odd elements (``x[..., 0::2]``,
  ``x[..., 1::2]``) -> mode 3 (interleave-half), the tables given to the op duplicated (``cat(c, c)``);
- half backward (``dy * cos + cat((dy * sin)[..., h:], -(dy * sin)[..., :h])``, the transpose of the half
  forward) -> InplacePartialRotaryMulGrad, mode 0; interleaved backward (``dy * cos + stack((dy * sin)[..., 1::2],
  -(dy * sin)[..., 0::2], -1)`` flattened) -> mode 1.
The tables must already be rank 4 (a near miss says so otherwise); the op's own rules check the rest.
"""

from __future__ import annotations

from ..patterns import GraphView, Match, NearMiss, register_pattern
from .schema import FORWARD, GRAD


def _halves(view: GraphView, first, second):
    """x when ``first`` is x[..., :h] and ``second`` x[..., h:] of one x (by Slice or one Split), else None."""
    split_a, split_b = view.producer(first, "Split"), view.producer(second, "Split")
    if split_a is not None and split_a is split_b and first is split_a.outputs[0] and second is split_a.outputs[1] \
            and len(split_a.outputs) == 2:
        x = split_a.inputs[0]
        axis = int(split_a.attributes.get("axis", 0))
        sizes = view.ints(split_a.inputs[1]) if len(split_a.inputs) > 1 and split_a.inputs[1] is not None else None
        d = x.type.shape[-1]
        if view.last_axis(x, axis) and isinstance(d, int) and (sizes is None or sizes == [d // 2, d // 2]):
            return x, [split_a]
        return None
    a, b = view.slice_of(first), view.slice_of(second)
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, axis, start_a, stop_a, step_a = a
    _, axis_b, start_b, stop_b, step_b = b
    d = x.type.shape[-1]
    if not (view.last_axis(x, axis) and axis == axis_b and step_a == step_b == 1 and start_a == 0
            and stop_a == start_b and stop_b == d and 2 * stop_a == d):
        return None
    return x, [first.producer, second.producer]


def _rotate_half(view: GraphView, value):
    """(x, nodes) when ``value`` is rotate_half(x) = cat(-x2, x1) on the last axis."""
    concat = view.producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or not view.last_axis(value, int(concat.attributes["axis"])):
        return None
    neg = view.producer(concat.inputs[0], "Neg")
    if neg is None:
        return None
    found = _halves(view, concat.inputs[1], neg.inputs[0])
    if found is None:
        return NearMiss("rotate_half's pieces are not x[..., :d/2] and x[..., d/2:] of one x whose last dim d is "
                        "static (their bounds, or the sliced dim, are not known before the graph runs)")
    return found[0], [concat, neg, *found[1]]


def _stacked_pair(view: GraphView, value):
    """(first, second, reshape, nodes) when ``value`` is stack(first, second, -1) flattened back (Unsqueeze both
    on the new last axis, Concat on it, Reshape or Flatten), a NearMiss when the Unsqueezes add another axis, else
    None."""
    reshape = view.producer(value, "Reshape", "Flatten")
    if reshape is None:
        return None
    concat = view.producer(reshape.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2 or not view.last_axis(concat.outputs[0], int(concat.attributes["axis"])):
        return None
    parts = [view.producer(v, "Unsqueeze") for v in concat.inputs]
    if None in parts:
        return None
    for part in parts:   # each half gets the new last axis; any other axis makes Concat + Reshape another permutation
        rank = len(part.outputs[0].type.shape)
        axes = view.ints(part.inputs[1]) if len(part.inputs) > 1 else None
        if axes is None or len(axes) != 1 or axes[0] % rank != rank - 1:
            return NearMiss(f"Unsqueeze '{part.name}' before the stack adds axis {axes}, not the last axis "
                            f"({rank - 1} or -1): the flatten would not interleave the pair")
    return parts[0].inputs[0], parts[1].inputs[0], reshape, [reshape, concat, *parts]


def _odd_even(view: GraphView, odd_value, even_value, reshape):
    """(x, nodes) when the values are x[..., 1::2] and x[..., 0::2] of one x that ``reshape`` gives back whole."""
    odd, even = view.slice_of(odd_value), view.slice_of(even_value)
    if odd is None or even is None or odd[0] is not even[0]:
        return None
    x = odd[0]
    d = x.type.shape[-1]
    if not (view.last_axis(x, odd[1]) and odd[1] == even[1]) or (odd[2], odd[4], even[2], even[4]) != (1, 2, 0, 2) \
            or odd[3] < d or even[3] < d - 1:
        return None
    if tuple(reshape.outputs[0].type.shape) != tuple(x.type.shape) and not _flattens_to(view, reshape, x):
        return NearMiss("matches only with static shapes: the flatten after the stack has a target computed at run "
                        "time that does not fold to x's shape")
    return x, [odd_value.producer, even_value.producer]


def _rotate_every_two(view: GraphView, value):
    """(x, nodes) when ``value`` is stack(-x[..., 1::2], x[..., 0::2], -1) flattened back to x's shape."""
    found = _stacked_pair(view, value)
    if isinstance(found, NearMiss):
        return found
    neg = view.producer(found[0], "Neg") if found is not None else None
    if neg is None:
        return None
    pair = _odd_even(view, neg.inputs[0], found[1], found[2])
    return pair if pair is None or isinstance(pair, NearMiss) else (pair[0], [*found[3], neg, *pair[1]])


def _flattens_to(view: GraphView, reshape, x) -> bool:
    """Whether ``reshape`` (a Reshape whose target is a foldable shape computation) gives x's static shape."""
    return x.type.is_static and view.reshaped_shape(reshape) == tuple(x.type.shape)


def _tables_rank_4(x, cos, sin) -> NearMiss | None:
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if len(t.type.shape) != 4:
            return NearMiss(f"{name} has rank {len(t.type.shape)}; the rotary ops take rank-4 x, cos and sin "
                            f"(unsqueeze the tables to (B|1, S|1, N|1, D) first)")
    return None


def _rope(view: GraphView, add, rotation, mode: int):
    """x * cos + rotation(x) * sin, either product order and either operand order."""
    terms = [view.producer(v, "Mul") for v in add.inputs]
    if None in terms:
        return None
    missed = None
    for rotated_mul, plain_mul in (terms, terms[::-1]):
        for i in (0, 1):
            found = rotation(view, rotated_mul.inputs[i])
            if isinstance(found, NearMiss):        # said if no other reading of the products matches
                missed = missed or found
                continue
            if found is None:
                continue
            x, nodes = found
            sin = rotated_mul.inputs[1 - i]
            if x not in plain_mul.inputs:
                return NearMiss(f"the rotated term reads '{x.name}' but the other product does not multiply it")
            cos = plain_mul.inputs[1 - plain_mul.inputs.index(x)]
            miss = _tables_rank_4(x, cos, sin)
            if miss is not None:
                return miss
            d = x.type.shape[-1]
            return Match(FORWARD.op_type, [x, cos, sin], {"rotary_mode": mode, "partial_slice": [0, d]},
                         add.outputs[0], [add, rotated_mul, plain_mul, *nodes])
    return missed


@register_pattern("rotary half (x * cos + rotate_half(x) * sin)", "Add")
def _half(view: GraphView, add):
    return _rope(view, add, _rotate_half, 0)


@register_pattern("rotary interleaved (x * cos + rotate_every_two(x) * sin)", "Add")
def _interleaved(view: GraphView, add):
    return _rope(view, add, _rotate_every_two, 1)


def _tiles(view: GraphView, concat, x, spans: dict[int, tuple[int, int]]) -> NearMiss | None:
    """None when the Concat's inputs tile x's last axis in order: those in ``spans`` (index -> [begin, end) of x they
    stand for, the rope's), every other a slice or a Split piece of x; else a NearMiss saying where not."""
    position = 0
    for i, piece in enumerate(concat.inputs):
        if i in spans:
            begin, end = spans[i]
        else:
            part = view.piece_of(piece)
            if part is None or part[0] is not x or part[4] != 1 or not view.last_axis(x, part[1]):
                return NearMiss(f"input {i} of the Concat is not a slice or a Split piece of '{x.name}' on its last "
                                f"axis")
            begin, end = part[2], part[3]
        if begin != position:
            return NearMiss(f"the Concat's pieces do not tile '{x.name}'s last axis in order (piece {i} starts at "
                            f"{begin}, expected {position})")
        position = end
    if position != x.type.shape[-1]:
        return NearMiss(f"the Concat's pieces cover [0, {position}) of a last axis of {x.type.shape[-1]}")
    return None


@register_pattern("rotary partial (cat(x[..., :s], rope(x[..., s:e]), x[..., e:]))", "Concat")
def _partial(view: GraphView, concat):
    if not view.last_axis(concat.outputs[0], int(concat.attributes["axis"])):
        return None
    ropes = [i for i, v in enumerate(concat.inputs) if v.producer is not None and v.producer.op_type == FORWARD.op_type]
    if len(ropes) != 1:
        return None
    rope = concat.inputs[ropes[0]].producer
    inner = view.piece_of(rope.inputs[0])
    if inner is None or inner[4] != 1 or not view.last_axis(inner[0], inner[1]):
        return NearMiss("the rope's input is not a slice or a Split piece of the head dim")
    x, _, start, stop, _ = inner
    if list(rope.attributes["partial_slice"]) not in ([0, stop - start], []):
        return None
    miss = _tiles(view, concat, x, {ropes[0]: (start, stop)})
    if miss is not None:
        return miss
    nodes = [concat, rope, rope.inputs[0].producer] + [v.producer for i, v in enumerate(concat.inputs) if i != ropes[0]]
    return Match(FORWARD.op_type, [x, rope.inputs[1], rope.inputs[2]],
                 {"rotary_mode": rope.attributes["rotary_mode"], "partial_slice": [start, stop]}, concat.outputs[0],
                 nodes)


def _even_odd(view: GraphView, first, second):
    """(x, nodes) when ``first`` is x[..., 0::2] and ``second`` x[..., 1::2] of one x of even static last dim."""
    a, b = view.slice_of(first), view.slice_of(second)
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, axis, start_a, stop_a, step_a = a
    d = x.type.shape[-1]
    if not (view.last_axis(x, axis) and axis == b[1] and isinstance(d, int) and d % 2 == 0):
        return None
    if (start_a, step_a, b[2], b[4]) != (0, 2, 1, 2) or len(range(*a[2:])) != d // 2 or len(range(*b[2:])) != d // 2:
        return None
    return x, [first.producer, second.producer]


def _duplicated(builder, table, name: str):
    """A half-width table as the op takes it: the same values for both halves of the rotated width."""
    return builder.op("Concat", table, table, axis=-1, name=name)


def _products(view: GraphView, node):
    """The two Mul nodes ``node`` (a Sub or an Add) combines, else None."""
    muls = [view.producer(v, "Mul") for v in node.inputs]
    return None if None in muls else muls


def _factor_pairs(mul):
    """Both readings (value, table) of a Mul's two operands."""
    return [(mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])]


def _half_width_rope(view: GraphView, sub, add):
    """(x, c, s, mode, nodes) when ``sub`` and ``add`` are ``a * c - b * s`` and ``b * c + a * s`` with a, b the
    halves (mode 0) or the even and odd elements (mode 3) of x's last axis and c, s of half its width; a NearMiss
    when the products are of that form but read no such pair or the tables do not fit; else None."""
    pair, terms = _products(view, sub), _products(view, add)
    if pair is None or terms is None:
        return None
    first, second = pair
    combined = [{id(v) for v in m.inputs} for m in terms]
    shaped = False
    for a, c in _factor_pairs(first):
        for b, s in _factor_pairs(second):
            if {id(b), id(c)} not in combined or {id(a), id(s)} not in combined or combined[0] == combined[1]:
                continue
            shaped = True
            for pairing, mode in ((_halves, 0), (_even_odd, 3)):
                found = pairing(view, a, b)
                if found is None:
                    continue
                x, nodes = found
                d = x.type.shape[-1]
                miss = _tables_rank_4(x, c, s)
                if miss is not None:
                    return miss
                if c.type.shape[-1] != d // 2 or s.type.shape[-1] != d // 2:
                    return NearMiss(f"the tables' last dims are {c.type.shape[-1]} and {s.type.shape[-1]}, not half "
                                    f"of x's {d}: they cannot be duplicated to the rotated width")
                return x, c, s, mode, [sub, add, first, second, *terms, *nodes]
    if shaped:
        return NearMiss("the products do not read the two halves, or the even and odd elements, of one tensor's "
                        "last axis")
    return None


@register_pattern("rotary half-width tables (cat(a * c - b * s, b * c + a * s))", "Concat")
def _half_width(view: GraphView, concat):
    """The rope alone (a Concat of the two terms) or, as TorchScript writes MLA's, merged with the pass-through
    pieces of the tensor it is a piece of (``cat(q[..., :s], a * c - b * s, b * c + a * s)``): partial_slice then."""
    if not view.last_axis(concat.outputs[0], int(concat.attributes["axis"])):
        return None
    at = next((i for i in range(len(concat.inputs) - 1) if view.producer(concat.inputs[i], "Sub") is not None
               and view.producer(concat.inputs[i + 1], "Add") is not None), None)
    if at is None:
        return None
    found = _half_width_rope(view, concat.inputs[at].producer, concat.inputs[at + 1].producer)
    if found is None or isinstance(found, NearMiss):
        return found
    x, c, s, mode, nodes = found
    d = x.type.shape[-1]
    start, stop, whole = 0, d, x
    if len(concat.inputs) > 2:
        piece = view.piece_of(x)
        if piece is None or piece[4] != 1 or not view.last_axis(piece[0], piece[1]):
            return NearMiss("the rope merged into a Concat with other pieces reads no slice or Split piece of one "
                            "tensor's last axis")
        whole, _, start, stop, _ = piece
        miss = _tiles(view, concat, whole, {at: (start, start + d // 2), at + 1: (start + d // 2, stop)})
        if miss is not None:
            return miss
        nodes = nodes + [x.producer] + [v.producer for i, v in enumerate(concat.inputs) if i not in (at, at + 1)]
    return Match(FORWARD.op_type, [whole, c, s], {"rotary_mode": mode, "partial_slice": [start, stop]},
                 concat.outputs[0], [concat, *nodes], transforms={1: _duplicated, 2: _duplicated})


@register_pattern("rotary half backward (dy * cos + cat((dy * sin)[..., h:], -(dy * sin)[..., :h]))", "Add")
def _half_backward(view: GraphView, add):
    for plain, moved in (add.inputs, add.inputs[::-1]):
        plain_mul, concat = view.producer(plain, "Mul"), view.producer(moved, "Concat")
        if plain_mul is None or concat is None or len(concat.inputs) != 2:
            continue
        neg = view.producer(concat.inputs[1], "Neg")
        if neg is None or not view.last_axis(moved, int(concat.attributes["axis"])):
            continue
        found = _halves(view, neg.inputs[0], concat.inputs[0])
        if found is None:
            continue
        product, nodes = found
        match = _backward(view, add, plain_mul, product, 0, [concat, neg, *nodes])
        if match is not None:
            return match
    return None


def _backward(view: GraphView, add, plain_mul, product, mode: int, nodes: list):
    """The grad op for ``add = dy * cos + moved(dy * sin)`` once ``product`` is known to be the moved ``dy * sin``;
    None when ``product`` is no such product."""
    sin_mul = view.producer(product, "Mul")
    if sin_mul is None:
        return None
    dy = next((v for v in sin_mul.inputs if v in plain_mul.inputs), None)
    if dy is None:
        return NearMiss("the two products do not share the gradient they multiply")
    sin = sin_mul.inputs[1 - sin_mul.inputs.index(dy)]
    cos = plain_mul.inputs[1 - plain_mul.inputs.index(dy)]
    miss = _tables_rank_4(dy, cos, sin)
    if miss is not None:
        return miss
    return Match(GRAD.op_type, [dy, cos, sin], {"rotary_mode": mode, "partial_slice": [0, dy.type.shape[-1]]},
                 add.outputs[0], [add, plain_mul, sin_mul, *nodes])


@register_pattern("rotary interleaved backward (dy * cos + stack((dy * sin)[..., 1::2], -(dy * sin)[..., 0::2]))",
                  "Add")
def _interleaved_backward(view: GraphView, add):
    for plain, moved in (add.inputs, add.inputs[::-1]):
        plain_mul, found = view.producer(plain, "Mul"), _stacked_pair(view, moved)
        if isinstance(found, NearMiss):
            return found
        neg = view.producer(found[1], "Neg") if found is not None else None
        if plain_mul is None or neg is None:
            continue
        pair = _odd_even(view, found[0], neg.inputs[0], found[2])
        if isinstance(pair, NearMiss):
            return pair
        if pair is None:
            continue
        match = _backward(view, add, plain_mul, pair[0], 1, [*found[3], neg, *pair[1]])
        if match is not None:
            return match
    return None

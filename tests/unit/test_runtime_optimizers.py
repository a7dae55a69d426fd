"""The PS optimizers (C kernels, dense and by rows) against the textbook update rules and NumPy."""

import ml_dtypes
import numpy as np
import pytest

from tfps.api.spec import OptimizerSpec
from tfps.runtime import _rows
from tfps.runtime.optimizers import NonFiniteGradient, ShardOptimizer

RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(6, 3)).astype(np.float32)
GRADS = [RNG.normal(size=(6, 3)).astype(np.float32) for _ in range(3)]


def reference(name: str, spec: OptimizerSpec, w, grads):
    w = w.astype(np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    acc = np.full_like(w, spec.initial_accumulator)
    lr = spec.learning_rate
    for t, g in enumerate(grads, start=1):
        if name == "sgd":
            w -= lr * g
        elif name == "momentum":
            m = spec.momentum * m + g
            w -= lr * m
        elif name == "adam":
            m = spec.beta1 * m + (1 - spec.beta1) * g
            v = spec.beta2 * v + (1 - spec.beta2) * g * g
            lr_t = lr * np.sqrt(1 - spec.beta2**t) / (1 - spec.beta1**t)
            w -= lr_t * m / (np.sqrt(v) + spec.epsilon)
        elif name == "adagrad":
            acc += g * g
            w -= lr * g / (np.sqrt(acc) + spec.epsilon)
    return w


def _setup(name):
    spec = OptimizerSpec(name=name, learning_rate=0.05)
    opt = ShardOptimizer(spec)
    var = W0.copy()
    slots = {s: opt.initial_slot(s, W0.shape) for s in opt.slot_names()}
    return spec, opt, var, slots


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_dense_update_matches_the_textbook_rule(name):
    spec, opt, var, slots = _setup(name)
    for t, g in enumerate(GRADS, start=1):
        before = {"var": var.copy(), **{s: a.copy() for s, a in slots.items()}}
        new_var, new_slots = opt.apply_dense(var, slots, g, t)
        # the given arrays are left as they were: a reader holding them keeps a consistent copy
        np.testing.assert_array_equal(var, before["var"])
        for s, a in slots.items():
            np.testing.assert_array_equal(a, before[s])
        var, slots = new_var, {**slots, **new_slots}
    np.testing.assert_allclose(var, reference(name, spec, W0, GRADS), rtol=1e-5, atol=1e-6)


def _numpy_update(name: str, opt: ShardOptimizer, var, slots, g, t):
    """The update as float32 NumPy expressions, one operation at a time, in the textbook's order."""
    f = np.float32
    lr, eps = f(opt.spec.learning_rate), f(opt.spec.epsilon)
    if name == "sgd":
        return var - g * lr, {}
    if name == "momentum":
        acc = slots["momentum"] * f(opt.spec.momentum) + g
        return var - acc * lr, {"momentum": acc}
    if name == "adam":
        b1, b2 = f(opt.spec.beta1), f(opt.spec.beta2)
        m = slots["m"] * b1 + g * (f(1) - b1)
        v = slots["v"] * b2 + g * g * (f(1) - b2)
        return var - m / (np.sqrt(v) + eps) * opt._adam_rate(t), {"m": m, "v": v}
    acc = g * g + slots["accumulator"]
    return var - g / (np.sqrt(acc) + eps) * lr, {"accumulator": acc}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_the_dense_kernels_round_every_float_as_numpy_does(name):
    _, opt, var, slots = _setup(name)
    rng = np.random.default_rng(5)
    var, grads = rng.normal(size=(700, 33)).astype(np.float32), rng.normal(size=(3, 700, 33)).astype(np.float32)
    slots = {s: opt.initial_slot(s, var.shape) for s in opt.slot_names()}
    expected, expected_slots = var, dict(slots)
    for t, g in enumerate(grads, start=1):
        var, new_slots = opt.apply_dense(var, slots, g, t)
        slots = {**slots, **new_slots}
        expected, numpy_slots = _numpy_update(name, opt, expected, expected_slots, g, t)
        expected_slots = {**expected_slots, **numpy_slots}
    np.testing.assert_array_equal(var, expected)
    for s in slots:
        np.testing.assert_array_equal(slots[s], expected_slots[s])


def test_a_bfloat16_dense_gradient_is_applied_as_float32():
    spec, opt, var, slots = _setup("sgd")
    grad = GRADS[0].astype(ml_dtypes.bfloat16)
    new_var, _ = opt.apply_dense(var, slots, grad, 1)
    np.testing.assert_allclose(new_var, reference("sgd", spec, W0, [grad.astype(np.float32)]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", [[4, 1, 4], [1, 4, 4], [1, 4], [4, 1]])  # a repeated row is summed, in any order
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_sparse_update_moves_only_the_touched_rows(name, order):
    spec, opt, var, slots = _setup(name)
    rows = np.array(order, np.int64)
    values = RNG.normal(size=(len(rows), 3)).astype(np.float32)
    opt.apply_sparse(var, slots, rows, values, 1)
    after = var
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(after[untouched], W0[untouched])
    dense = np.zeros_like(W0)
    np.add.at(dense, rows, values)
    expected = reference(name, spec, W0, [dense])
    np.testing.assert_allclose(after[[1, 4]], expected[[1, 4]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_a_row_updated_sparsely_is_bit_for_bit_the_row_a_dense_update_makes(name):
    """The row kernels and the dense ones do the same float operations in the same order: three
    steps on 300 scattered rows of a 5000-row table leave each row exactly as `apply_dense` does."""
    spec = OptimizerSpec(name=name, learning_rate=0.05)
    opt = ShardOptimizer(spec)
    rng = np.random.default_rng(3)
    table = rng.normal(size=(5000, 64)).astype(np.float32)
    slots = {s: opt.initial_slot(s, table.shape) for s in opt.slot_names()}
    rows = np.sort(rng.choice(len(table), 300, replace=False))
    dense_var, dense_slots = table[rows].copy(), {s: a[rows].copy() for s, a in slots.items()}
    untouched = np.setdiff1d(np.arange(len(table)), rows)
    before = table[untouched].copy()
    for t in range(1, 4):
        grad = rng.normal(size=(len(rows), 64)).astype(np.float32)
        opt.apply_sparse(table, slots, rows, grad, t)
        dense_var, new_slots = opt.apply_dense(dense_var, dense_slots, grad, t)
        dense_slots.update(new_slots)
    np.testing.assert_array_equal(table[rows], dense_var)
    for s, a in slots.items():
        np.testing.assert_array_equal(a[rows], dense_slots[s])
    np.testing.assert_array_equal(table[untouched], before)


def test_the_row_kernels_refuse_arguments_that_do_not_fit_and_leave_the_table_as_it_was():
    table = np.ones((10, 4), np.float32)
    grad = np.ones((2, 4), np.float32)
    cases = [
        (ValueError, "outside the table", (table, np.array([3, 10], np.int64), grad)),
        (ValueError, "outside the table", (table, np.array([-1, 3], np.int64), grad)),
        (ValueError, "width", (table, np.array([1, 2], np.int64), np.ones((2, 3), np.float32))),
        (ValueError, "2 rows", (table, np.array([1, 2], np.int64), np.ones((3, 4), np.float32))),
        (
            TypeError,
            "gradient: expected a 2-D array of float32, got 2-D of format 'd'",
            (table, np.array([1, 2], np.int64), grad.astype(np.float64)),
        ),
        (TypeError, "int64", (table, np.array([1, 2], np.int32), grad)),
        (ValueError, "not C-contiguous", (table[:, :2], np.array([1, 2], np.int64), grad[:, :2])),
    ]
    for error, words, args in cases:
        with pytest.raises(error, match=words):
            _rows.update_rows(0, (0.5, 0, 0, 0), (), args[0], {}, *args[1:])
        np.testing.assert_array_equal(table, np.ones((10, 4), np.float32))
    with pytest.raises(ValueError, match="shape differs"):
        _rows.update_rows(
            2,
            (0.9, 0.999, 0.1, 1e-7),
            ("m", "v"),
            table,
            {"m": np.zeros((10, 4), np.float32), "v": np.zeros((9, 4), np.float32)},
            np.array([1], np.int64),
            grad[:1],
        )
    with pytest.raises(ValueError, match="the table overlaps a slot"):  # the kernels take them as restrict pointers
        _rows.update_rows(
            1, (0.5, 0.9, 0, 0), ("momentum",), table, {"momentum": table}, np.array([1], np.int64), grad[:1]
        )
    with pytest.raises(KeyError, match="no slot 'v'"):
        _rows.update_rows(
            2,
            (0.9, 0.999, 0.1, 1e-7),
            ("m", "v"),
            table,
            {"m": np.zeros((10, 4), np.float32)},
            np.array([1], np.int64),
            grad[:1],
        )
    for opt, names in ((2, ("m",)), (0, ("m",)), (4, ())):
        with pytest.raises(ValueError, match="update_rows: an optimizer 0..3 and a tuple of its slots"):
            _rows.update_rows(
                opt,
                (0.5, 0, 0, 0),
                names,
                table,
                {"m": np.zeros((10, 4), np.float32)},
                np.array([1], np.int64),
                grad[:1],
            )
    np.testing.assert_array_equal(table, np.ones((10, 4), np.float32))


def test_the_dense_kernels_refuse_a_gradient_of_another_size_or_type_and_leave_the_variable_as_it_was():
    var, grad = np.ones((6, 3), np.float32), np.ones((6, 3), np.float32)
    slots = {"m": np.zeros((6, 3), np.float32), "v": np.zeros((6, 3), np.float32)}
    cases = [
        (ValueError, "gradient of 9 floats for a variable of 18", grad[:3]),
        (TypeError, "gradient: expected an array of float32, got format 'd'", grad.astype(np.float64)),
    ]
    for error, words, bad in cases:
        with pytest.raises(error, match=words):
            _rows.update_dense(2, (0.9, 0.999, 0.1, 1e-7), ("m", "v"), var, slots, bad)
    np.testing.assert_array_equal(var, np.ones((6, 3), np.float32))
    for name, arr in slots.items():
        np.testing.assert_array_equal(arr, np.zeros((6, 3), np.float32), err_msg=name)
    finite, new, fresh = _rows.update_dense(2, (0.9, 0.999, 0.1, 1e-7), ("m", "v"), var, slots, grad)
    assert finite is True and list(fresh) == ["m", "v"]
    assert all(arr is not var and not np.shares_memory(arr, var) for arr in (new, *fresh.values()))


def test_check_rows_says_whether_rows_are_sorted_and_unique_and_refuses_rows_outside():
    assert _rows.check_rows(np.array([0, 3, 9], np.int64), 10) is True
    assert _rows.check_rows(np.array([], np.int64), 10) is True
    assert _rows.check_rows(np.array([3, 3], np.int64), 10) is False
    assert _rows.check_rows(np.array([4, 1], np.int64), 10) is False
    for rows in ([0, 10], [-1, 2]):
        with pytest.raises(ValueError, match="outside 0..9"):
            _rows.check_rows(np.array(rows, np.int64), 10)


def test_take_copies_the_rows_asked_for_as_numpy_does_and_refuses_rows_outside():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((1000, 16)).astype(np.float32)
    rows = np.array([999, 0, 17, 17, 500, *range(100, 140)], np.int64)  # any order, repeats too
    out = np.empty((len(rows), 16), np.float32)
    _rows.take(table, rows, out)
    np.testing.assert_array_equal(out, np.take(table, rows, axis=0))
    _rows.take(table, np.array([], np.int64), np.empty((0, 16), np.float32))
    with pytest.raises(ValueError, match="outside the table"):
        _rows.take(table, np.array([3, 1000], np.int64), np.empty((2, 16), np.float32))
    with pytest.raises(ValueError, match="for 2 rows"):
        _rows.take(table, np.array([3, 4], np.int64), np.empty((3, 16), np.float32))


@pytest.mark.parametrize("size", [1, 1000, 200_000])  # the largest is checked with the GIL released
def test_finite_finds_any_nan_or_inf_and_passes_the_largest_finite_floats(size):
    values = np.full(size, np.finfo(np.float32).max, np.float32)
    values[::2] = -np.finfo(np.float32).tiny
    assert _rows.finite(values) is True
    assert _rows.finite(values.reshape(size, 1)) is True
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, size // 2, size - 1):
            broken = values.copy()
            broken[where] = bad
            assert _rows.finite(broken) is False, (bad, where)
    assert _rows.finite(np.zeros(0, np.float32)) is True
    with pytest.raises(TypeError, match="expected an array of float32, got format 'd'"):
        _rows.finite(np.zeros(3))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_a_sync_mean_made_in_the_update_pass_is_bit_for_bit_numpys(name):
    """A sync step's mean gradient (the others' sum plus the last push, times 1/n) is made inside
    the dense kernel's pass: the same floats as adding and scaling first."""
    _, opt, _, _ = _setup(name)
    rng = np.random.default_rng(6)
    var, pushes = rng.normal(size=(300, 17)).astype(np.float32), rng.normal(size=(3, 300, 17)).astype(np.float32)
    slots = {s: opt.initial_slot(s, var.shape) for s in opt.slot_names()}
    scale = np.float32(1 / 3)
    others = pushes[0] + pushes[1]
    new, new_slots = opt.apply_dense(var, slots, others, 4, plus=pushes[2], scale=float(scale))
    expected, expected_slots = _numpy_update(name, opt, var, slots, (others + pushes[2]) * scale, 4)
    np.testing.assert_array_equal(new, expected)
    for s in new_slots:
        np.testing.assert_array_equal(new_slots[s], expected_slots[s])
    with pytest.raises(ValueError, match="second gradient of 5 floats"):
        opt.apply_dense(var, slots, others, 4, plus=np.zeros(5, np.float32))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_a_dense_update_finds_a_nan_or_an_inf_in_its_own_pass(name):
    """The dense kernels check the gradient they apply as they go (no pass of its own); the
    variable and slots given are left as they were."""
    _, opt, var, slots = _setup(name)
    before = var.copy()
    for bad in (np.nan, np.inf, -np.inf):
        grad = GRADS[0].copy()
        grad.flat[-1] = bad
        with pytest.raises(NonFiniteGradient):
            opt.apply_dense(var, slots, grad, 1)
        opt.apply_dense(var, slots, grad, 1, check=False)  # a sync step's mean: checked on arrival
    huge = np.full_like(GRADS[0], np.finfo(np.float32).max)
    with pytest.raises(NonFiniteGradient):  # the mean's sum overflows
        opt.apply_dense(var, slots, huge, 1, plus=huge, scale=0.5)
    np.testing.assert_array_equal(var, before)
    opt.apply_dense(var, slots, huge, 1)  # the largest finite floats are finite


SUBNORMAL = np.float32(1e-39)  # below float32's smallest normal, 1.18e-38


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_subnormal_floats_are_taken_as_zero_as_tensorflow_takes_them_and_the_callers_are_not(name):
    """A slot decaying towards zero (Adam's first moment where a unit's gradient is zero) would
    otherwise sit in the subnormal range, where every float operation is many times slower: the
    kernels run with subnormals flushed to zero, as TensorFlow's CPU kernels do, by rows and dense alike."""
    _, opt, var, slots = _setup(name)
    tiny = np.full_like(W0, SUBNORMAL)
    slots = {s: tiny.copy() for s in slots}
    decaying = {"momentum": "momentum", "adam": "m"}.get(name)  # decayed, it becomes zero, not a smaller subnormal
    new_var, new_slots = opt.apply_dense(W0, slots, tiny, 1)
    np.testing.assert_array_equal(new_var, W0)  # a subnormal gradient moves nothing
    if decaying:
        np.testing.assert_array_equal(new_slots[decaying], 0)
    table, rows, row_slots = W0.copy(), np.array([1, 4], np.int64), {s: a.copy() for s, a in slots.items()}
    opt.apply_rows(table, row_slots, rows, tiny[:2], 1)
    np.testing.assert_array_equal(table, W0)
    if decaying:
        np.testing.assert_array_equal(row_slots[decaying][rows], 0)
        np.testing.assert_array_equal(
            np.delete(row_slots[decaying], rows, axis=0), SUBNORMAL
        )  # untouched rows untouched
    assert SUBNORMAL * np.float32(1) == SUBNORMAL  # the calling thread's own floats keep their subnormals

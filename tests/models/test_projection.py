"""flexmarl_jax/models/projection.py: `project` has the values and gradients of `jnp.einsum` for every spec the
decoder uses, in float32 and bfloat16 (with a float32 result, as the LM head)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl_jax.models.projection import project

# (spec, x shape, w shape) as in layers.py / decoder.py with small sizes: b=2, t=3, e=8, m=12, h=4, d=5, v=11
SPECS = [
    ("bte,em->btm", (2, 3, 8), (8, 12)),
    ("btm,me->bte", (2, 3, 12), (12, 8)),
    ("bte,ehd->bthd", (2, 3, 8), (8, 4, 5)),
    ("bthd,hde->bte", (2, 3, 4, 5), (4, 5, 8)),
    ("bte,ve->btv", (2, 3, 8), (11, 8)),
    ("bte,ev->btv", (2, 3, 8), (8, 11)),
]


def _value_and_grads(fn, spec, x, w, cotangent, preferred):
    out, pullback = jax.vjp(lambda a, b: fn(spec, a, b, preferred_element_type=preferred), x, w)
    return (out, *pullback(cotangent.astype(out.dtype)))


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
@pytest.mark.parametrize("dtype,preferred", [(jnp.float32, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.bfloat16, None)])
def test_project_matches_einsum(spec, x_shape, w_shape, dtype, preferred):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), dtype)
    w = jnp.asarray(rng.normal(size=w_shape), dtype)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    cotangent = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
    ours = _value_and_grads(project, spec, x, w, cotangent, preferred)
    reference = _value_and_grads(jnp.einsum, spec, x, w, cotangent, preferred)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in zip(ours, reference, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tolerance, atol=tolerance)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 5), e=st.integers(1, 6), m=st.integers(1, 7), seed=st.integers(0, 99))
def test_gradient_of_a_two_layer_net_matches_einsum(b, t, e, m, seed):
    """Chained projections (as in the MLP) give the same parameter gradients as plain einsums."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, e)), jnp.float32)
    params = (jnp.asarray(rng.normal(size=(e, m)), jnp.float32), jnp.asarray(rng.normal(size=(m, e)), jnp.float32))

    def loss(fn, params):
        hidden = jax.nn.silu(fn("bte,em->btm", x, params[0]))
        return jnp.sum(jnp.tanh(fn("btm,me->bte", hidden, params[1])))

    ours = jax.grad(lambda p: loss(project, p))(params)
    reference = jax.grad(lambda p: loss(jnp.einsum, p))(params)
    for got, want in zip(ours, reference, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

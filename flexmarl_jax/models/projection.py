"""`project`: an activation times a weight (one einsum) whose gradient XLA's CPU backend computes without slow
transposes.

Why. A weight's gradient contracts over the tokens, so both of its operands need the token axis as the
contraction axis of a dot. With the gradient JAX derives for `jnp.einsum`, XLA's CPU backend
lays that out by transposing the *incoming gradient* (e.g. the [tokens, 4864] SwiGLU gradient) and fuses
the elementwise ops that produce it into the transposing copy, which then runs about 25x slower than the
elementwise ops plus a plain copy (profile of a Qwen2.5-0.5B training step, 4 x 256 tokens: those fused
copies took about 10% of the step). Writing the two cotangents as einsums with the *activation* first,
``dW = einsum(x, g)``, makes XLA transpose the saved activation instead, which is a plain (fast) copy.

The forward pass and the values of both gradients are those of ``jnp.einsum(spec, x, w)`` (the same dots;
only which operand XLA lays out again changes). Being a `jax.custom_vjp`, it supports reverse-mode
differentiation only (grad / vjp), which is all training uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def project(spec: str, x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """``jnp.einsum(spec, x, w, preferred_element_type=...)`` for a two-operand `spec` "x_axes,w_axes->out_axes"
    in which every axis of `x` and of `w` appears in the output or in the other operand."""
    return _project(spec, preferred_element_type, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec, preferred_element_type, x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


def _project_forward(spec, preferred_element_type, x, w):
    return _project(spec, preferred_element_type, x, w), (x, w)


def _project_backward(spec, preferred_element_type, residuals, grad):
    del preferred_element_type
    x, w = residuals
    operands, out_axes = spec.split("->")
    x_axes, w_axes = operands.split(",")
    # The cotangents are computed in the gradient's dtype (float32 for a float32 output) and cast back, as
    # JAX's own rule for a dot with a wider result type does.
    grad_x = jnp.einsum(f"{out_axes},{w_axes}->{x_axes}", grad, w, preferred_element_type=grad.dtype)
    grad_w = jnp.einsum(f"{x_axes},{out_axes}->{w_axes}", x, grad, preferred_element_type=grad.dtype)
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype)


_project.defvjp(_project_forward, _project_backward)

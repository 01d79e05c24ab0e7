"""The autocast wing: :func:`jaxscale.autocast` and what it is made of.

From the bottom up (each module imports only those before it, and the JAX
adapter :mod:`jaxscale._jax_private`):

- :mod:`~jaxscale._autocast.rules`: the public per-primitive table
  (:class:`~jaxscale.AutocastRule`, :func:`~jaxscale.autocast_rules`);
- :mod:`~jaxscale._autocast.values`: what the interpreter keeps next to each
  value (provenance, constants) and the casts;
- :mod:`~jaxscale._autocast.interp`: the interpreter of first-order equations
  and the rule classes;
- :mod:`~jaxscale._autocast.hop`: the higher-order constructs (``jit``,
  ``scan``, ``cond``, custom derivatives, ``shard_map``) and the schema-free
  rewrite of any other;
- :mod:`~jaxscale._autocast.entry`: :func:`jaxscale.autocast` itself.

What autocast did to a function is reported by
:func:`jaxscale.diagnostics.autocast_report`, in the diagnostics wing.
"""

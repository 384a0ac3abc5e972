"""Context strategies behind one registry: adding one is one module plus one line here.

Each takes global q [batch, length, heads, dqk], k / v [batch, length, kv_heads, d], segment ids
[batch, length] or None, and returns [batch, length, heads, dv] in the same (parallelism.layout) order.
"""

from parallel.strategies import all_gather, none, ring, ulysses, usp

STRATEGIES = {
    "none": none.attention,
    "all_gather": all_gather.attention,
    "ring": ring.attention,
    "ulysses": ulysses.attention,
    "usp": usp.attention,
}

ROTATES_LATENT = ("ring", "usp")  # the strategies that take MLA's latent (parallel/latent.py) in place of K/V

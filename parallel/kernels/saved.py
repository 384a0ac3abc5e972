"""The names attention's results carry for a remat policy (models/remat.py's save_attention): every strategy's forward
names the out and log-sum-exp its backward keeps, so a policy that saves them recomputes a layer's projections in
the backward but not its attention, the costliest part at long context."""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

OUT, LSE = "attention_out", "attention_lse"
NAMES = (OUT, LSE)


def named(out, lse):
    """(out, lse) [batch, t, heads, dv] / [batch, t, heads] as they are, named for the policy."""
    return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)

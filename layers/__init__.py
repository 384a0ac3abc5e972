"""Model building blocks: parameters annotated with logical axis names, no device placement."""

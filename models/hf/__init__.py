"""Hugging Face checkpoints <-> longctx models: `load_pretrained(dir)`, `save_pretrained(model, dir)`, and the
`python -m train.hf import|export` command line (train/hf.py). Per-family tables live in
models/hf/<family>.py and are registered in models/hf/families.py."""

from models.hf.convert import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]

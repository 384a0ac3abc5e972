"""The tiny model configurations the tests share; a test changes what it needs with `dataclasses.replace`.

TINY_LLAMA: grouped-query attention (4 query heads over 2 key/value heads of 8), one layer, 64 tokens x 32 wide.
TINY_MLA: DeepSeek's latent attention at the same width, one dense layer (add experts with `replace`).
"""

from models.config import ModelConfig

TINY_LLAMA = ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
TINY_MLA = ModelConfig(
    family="deepseek",
    vocab_size=64,
    embed_dim=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=4,
    head_dim=12,
    mlp_dim=64,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
)

"""The run configuration's schema: one frozen dataclass per YAML section (`model` and `compute` come from
models/config.py). Defaults here are the defaults of every run."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config import ComputeConfig, ModelConfig


@dataclass(frozen=True)
class MixtureComponent:
    """One source of `data.mixture`: its share of the train bytes (`weight`, normalized over the components) and
    how to read it; a field left unset (None) takes the `data` section's value."""

    source: str
    weight: float = 1.0
    format: str | None = None
    text_field: str | None = None
    file_pattern: str | None = None
    max_documents: int | None = None


# the values of data.format and data.packing, as train/sources.py and train/data.py implement them (a config
# is read without importing the data libraries)
FORMATS = ("auto", "text", "jsonl", "parquet")
PACKINGS = ("concat", "first_fit")


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes packed rows of `seq_len` tokens."""

    source: str = "stdlib"  # "stdlib", a text file, a folder, a .jsonl or a .parquet file
    format: str = "auto"  # auto | text | jsonl | parquet
    text_field: str = "text"
    file_pattern: str = "*"  # glob for folders
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    seq_len: int = 256
    packing: str = "concat"  # concat (split documents across rows) | first_fit (pad rows)
    shuffle: bool = True
    seed: int = 0
    eval_fraction: float = 0.02
    max_documents: int = 0  # 0 = all
    add_bos: bool = True
    add_eos: bool = True
    # long-document upsampling in the train split: documents of at least long_document_bytes (about 4 bytes per
    # token) appear long_document_weight times per epoch (a fraction by a seeded coin); 0 / 1 = off
    long_document_bytes: int = 0
    long_document_weight: float = 1.0
    # several sources mixed by weight (share of the bytes as stored, ~tokens; each held out and upsampled on its own);
    # when given, it replaces `source` (() = read `source` alone)
    mixture: tuple[MixtureComponent, ...] = ()


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * learning_rate`."""

    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int = 0  # 0 = train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 = no clipping
    # AdamW's first moment (mu): param = model.param_dtype (float32 unless set), float32 or bfloat16. The second
    # moment (nu) stays in model.param_dtype: its (1 - b2) * g^2 increments fall below bfloat16's resolution once
    # b2 > 0.996, so a bfloat16 nu beside float32 parameters would stop tracking the gradients
    mu_dtype: str = "param"


@dataclass(frozen=True)
class TrainConfig:
    """The loop: how long, how big a batch, where outputs go, how often to log and evaluate."""

    steps: int = 1000
    batch_size: int = 8  # global, in rows of data.seq_len tokens
    grad_accum_steps: int = 1
    output_dir: str = "runs/default"
    log_every_steps: int = 10
    eval_every_steps: int = 0  # 0 = only at the end
    eval_batches: int = 4  # 0 = no evaluation
    # token positions within a document where the eval loss is split: [1024, 4096] reports eval_loss/pos_0_1024,
    # eval_loss/pos_1024_4096 and eval_loss/pos_4096_<seq_len> beside eval_loss
    eval_position_buckets: tuple[int, ...] = ()
    # needle retrieval at every evaluation (train/needle.py): rows of these lengths, the asked needle at these
    # depths, needle_samples haystacks per point; logged as needle/<task>, the mean accuracy over the grid
    needle_lengths: tuple[int, ...] = ()  # () = off
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_samples: int = 4
    seed: int = 0
    progress_bar: bool = True
    sample_tokens: int = 120
    sample_prompt: str = "def "
    sample_temperature: float = 0.8  # 0 = greedy
    peak_tflops_per_device: float = 0.0  # 0 = look up, or measure on CPU


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under OUTPUT_DIR/checkpoints; `init_from` seeds params only."""

    enabled: bool = True
    every_steps: int = 500
    keep: int = 3
    async_save: bool = True
    init_from: str = ""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; one -1 takes the remaining devices."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    ulysses: int = 1  # usp only: heads split over this axis, inside the context (ring) axis
    tensor: int = 1


@dataclass(frozen=True)
class ParallelConfig:
    """How the step runs in parallel: attention when the sequence is split over mesh.context (and mesh.ulysses)
    and the kernel it uses, whether tensor parallelism scatters the residual stream, and how MoE tokens travel to
    the expert devices."""

    context_strategy: str = "none"  # none | all_gather | ring | ulysses | usp
    load_balance: bool = True  # reorder the sequence when mesh.context > 1 so causal work is even
    balance_layout: str = "dual_chunk"  # dual_chunk | striped
    stripe: int = 1  # tokens per stripe for the striped layout
    block_q: int = 256  # attention kernel block sizes (bench/README.md: 256 beats 512 on CPU in time and memory)
    block_kv: int = 256
    ring_grad_dtype: str = "float32"  # float32 | compute: dK/dV summed and sent around the ring in the compute dtype
    attention_kernel: str = (
        "auto"  # auto (GPU: cudnn on Hopper+, else pallas; elsewhere blockwise) | pallas | cudnn | blockwise
    )
    scatter_residual: bool = True  # mesh.tensor > 1: residual stream sharded on length over tensor (reduce-scatter)
    expert_dispatch: str = "auto"  # capacity | ragged (GPU/TPU) | auto: how MoE tokens travel to expert devices
    expert_capacity_factor: float = 1.25  # expert parallelism: dispatch buffer rows per expert / its balanced load
    expert_chunk_size: int = 0  # at most this many tokens per device through an MoE block at once; 0 = all


@dataclass(frozen=True)
class Config:
    """A run: the model, how it computes, its data, optimizer, loop, checkpoints, mesh and parallel plan."""

    model: ModelConfig = field(default_factory=ModelConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

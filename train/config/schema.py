"""The run configuration's schema: one frozen dataclass per YAML section (`model` and `compute` come from
models/config.py). Defaults here are the defaults of every run."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config import ComputeConfig, ModelConfig
from models.dtypes import PARAM_DTYPES


@dataclass(frozen=True)
class MixtureComponent:
    """One source of `data.mixture`: its share of the train bytes (`weight`, normalized over the components) and
    how to read it; a field left unset (None) takes the `data` section's value."""

    source: str  # a text file, a folder, a .jsonl or a .parquet file
    weight: float = 1.0  # its share of the train bytes, normalised over the components
    format: str | None = None  # as data.format; unset = data.format
    text_field: str | None = None  # as data.text_field; unset = data.text_field
    file_pattern: str | None = None  # as data.file_pattern; unset = data.file_pattern
    max_documents: int | None = None  # as data.max_documents; unset = data.max_documents


# the values of data.format, data.packing and data.on_change, as train/data/sources.py, train/data/pipeline.py and
# train/data/record.py implement them (a config is read without importing the data libraries)
FORMATS = ("auto", "text", "jsonl", "parquet")
PACKINGS = ("concat", "first_fit")
ON_CHANGE = ("refuse", "grown", "restart")
# the values of optimizer.mu_dtype, as train/optimizer.py implements them: what AdamW's first moment is stored in;
# param: the parameters' dtype (the second moment's, always)
MU_DTYPES = ("param", *PARAM_DTYPES)


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes packed rows of `seq_len` tokens."""

    # stdlib (the standard library's Python sources) | retrieval (synthetic needle-retrieval documents,
    # train/data/retrieval.py) | a text file, a folder, a .jsonl or a .parquet file
    source: str = "stdlib"
    format: str = "auto"  # auto | text | jsonl | parquet
    text_field: str = "text"  # the JSONL field or Parquet column holding the text
    file_pattern: str = "*"  # glob of the files a folder source reads
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    seq_len: int = 256  # tokens per row
    packing: str = "concat"  # concat (split documents across rows) | first_fit (pad rows)
    shuffle: bool = True  # shuffle the train documents (seeded)
    seed: int = 0  # the data order's and the held-out split's seed
    # share of each source's bytes held out for evaluation (a document too long to hold out whole gives its tail)
    eval_fraction: float = 0.02
    max_documents: int = 0  # documents read at most; 0 = all
    add_bos: bool = True  # a beginning-of-sequence token before each document
    add_eos: bool = True  # an end-of-sequence token after each document
    # long-document upsampling in the train split: documents of at least long_document_bytes (about 4 bytes per
    # token) appear long_document_weight times per epoch (a fraction by a seeded coin); 0 / 1 = off
    long_document_bytes: int = 0
    long_document_weight: float = 1.0  # how many times such a document appears per epoch (a fraction: a seeded coin)
    # several sources mixed by weight (share of the bytes as stored, ~tokens; each held out and upsampled on its own);
    # when given, it replaces `source` (() = read `source` alone)
    mixture: tuple[MixtureComponent, ...] = ()
    # a resume on data that changed since its checkpoint (train/data/record.py): refuse | grown (accept files added
    # or appended to) | restart (accept any change); both keep the model, optimizer and step and start the data
    # position fresh. A resumed run may change this setting, and with restart any other data setting
    on_change: str = "refuse"


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * learning_rate`."""

    learning_rate: float = 3e-4  # peak learning rate, after the warmup
    min_lr_ratio: float = 0.1  # the cosine decay ends at learning_rate x this
    warmup_steps: int = 100  # linear warmup from learning_rate / warmup_steps at the first update
    decay_steps: int = 0  # the cosine decay's length in steps; 0 = train.steps
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # decoupled weight decay (not on norm scales, biases or attention sinks)
    clip_norm: float = 1.0  # gradients clipped to this global norm; 0 = no clipping
    # AdamW's first moment (mu): param = model.param_dtype (float32 unless set), float32 or bfloat16. The second
    # moment (nu) stays in model.param_dtype: its (1 - b2) * g^2 increments fall below bfloat16's resolution once
    # b2 > 0.996, so a bfloat16 nu beside float32 parameters would stop tracking the gradients
    mu_dtype: str = "param"


@dataclass(frozen=True)
class TrainConfig:
    """The loop: how long, how big a batch, where outputs go, how often to log and evaluate."""

    steps: int = 1000  # optimizer updates in the whole run (raise it to train a resumed run further)
    batch_size: int = 8  # global, in rows of data.seq_len tokens
    grad_accum_steps: int = 1  # micro-batches per update (batch_size divides by it)
    output_dir: str = "runs/default"  # the run directory: checkpoints, metrics.jsonl, tensorboard/, config.yaml
    log_every_steps: int = 10  # steps between metrics lines
    eval_every_steps: int = 0  # steps between evaluations; 0 = only at the end
    eval_batches: int = 4  # held-out batches per evaluation; 0 = no evaluation
    # token positions within a document where the eval loss is split: [1024, 4096] reports eval_loss/pos_0_1024,
    # eval_loss/pos_1024_4096 and eval_loss/pos_4096_<seq_len> beside eval_loss
    eval_position_buckets: tuple[int, ...] = ()
    # needle retrieval at every evaluation (train/needle.py): rows of these lengths, the asked needle at these
    # depths, needle_samples haystacks per point; logged as needle/<task>, the mean accuracy over the grid
    needle_lengths: tuple[int, ...] = ()  # needle retrieval at every evaluation at these row lengths; () = off
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)  # where the asked needle sits, as a share of the row
    needle_samples: int = 4  # haystacks per (length, depth)
    # the tasks (train/data/haystack.py: single, multi_key, multi_value); () = all; each length must hold each task's
    # needles, question and answer (checked before training starts)
    needle_tasks: tuple[str, ...] = ()
    seed: int = 0  # the parameters' initialisation seed
    progress_bar: bool = True  # a progress bar on a terminal
    sample_tokens: int = 120  # tokens sampled from the model at the end of a run; 0 = none
    sample_prompt: str = "def "  # the prompt of that sample
    sample_temperature: float = 0.8  # that sample's temperature; 0 = greedy
    peak_tflops_per_device: float = 0.0  # the devices' peak TFLOP/s, MFU's denominator; 0 = look up, or measure on CPU


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under OUTPUT_DIR/checkpoints; `init_from` seeds params only."""

    enabled: bool = True  # save checkpoints (and resume from them)
    every_steps: int = 500  # steps between checkpoints (one is also saved at the end and on SIGTERM / Ctrl-C)
    keep: int = 3  # checkpoints kept, the newest
    async_save: bool = True  # write checkpoints in the background while training goes on
    # a checkpoint directory (its newest step), one step directory or an import (python -m train.hf import) whose
    # parameters start the run; the optimizer, step and data position start fresh; "" = initialise
    init_from: str = ""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; one -1 takes the remaining devices."""

    data: int = 1  # replicas of the model, each with its own rows of the batch
    fsdp: int = -1  # parameters, gradients and optimizer state sharded; the batch rows split too; -1 = the rest
    expert: int = 1  # routed experts spread over it; the batch rows split too
    context: int = 1  # each row's sequence split (parallel.context_strategy says how attention runs)
    ulysses: int = 1  # usp only: heads split over this axis, inside the context (ring) axis
    tensor: int = 1  # heads, MLP hidden units and the vocabulary split (tensor parallelism)


@dataclass(frozen=True)
class ParallelConfig:
    """How the step runs in parallel: attention when the sequence is split over mesh.context (and mesh.ulysses)
    and the kernel it uses, whether tensor parallelism scatters the residual stream, and how MoE tokens travel to
    the expert devices."""

    # none | all_gather | ring | ulysses | usp: how attention runs over a sequence split over mesh.context (required
    # then)
    context_strategy: str = "none"
    load_balance: bool = True  # reorder the sequence when mesh.context > 1 so causal work is even
    balance_layout: str = "dual_chunk"  # dual_chunk | striped
    stripe: int = 1  # tokens per stripe for the striped layout
    block_q: int = 256  # query tokens per attention kernel block (bench/README.md: 256 beats 512 on CPU)
    block_kv: int = 256  # key / value tokens per attention kernel block
    ring_grad_dtype: str = "float32"  # float32 | compute: dK/dV summed and sent around the ring in the compute dtype
    attention_kernel: str = (
        "auto"  # auto (GPU: cudnn on Hopper+, else pallas) | pallas | cudnn | blockwise | flash3 | tokamax
    )
    scatter_residual: bool = True  # mesh.tensor > 1: residual stream sharded on length over tensor (reduce-scatter)
    expert_dispatch: str = "auto"  # capacity | ragged (GPU/TPU) | auto: how MoE tokens travel to expert devices
    # unset: dropless (dispatch buffers hold every assignment); a number opts in to expert parallelism's buffers of
    # that many times an expert's balanced load, dropping the assignments past them (logged as "dropped"). It acts
    # only where experts split over devices (mesh.expert > 1): on one device every token is kept; --plan says which
    expert_capacity_factor: float | None = None
    # the experts' grouped matmul under the ragged dispatch: xla (ragged_dot; XLA's GPU compiler runs it dense over
    # every group) | tokamax (its Hopper kernel; the tokamax extra) | auto: tokamax on Hopper+ GPUs where installed
    grouped_matmul: str = "auto"
    expert_chunk_size: int = 0  # at most this many tokens per device through an MoE block at once; 0 = all


@dataclass(frozen=True)
class Config:
    """A run: the model, how it computes, its data, optimizer, loop, checkpoints, mesh and parallelism."""

    model: ModelConfig = field(default_factory=ModelConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

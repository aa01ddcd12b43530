"""Random-weight Llama models with a locally trained tokenizer, built offline for tests, demo and bench.

No model can be downloaded here, and none is needed: greedy output from fixed random weights is
deterministic, which is all an output-identity oracle needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORDS = tuple(
    (
        "the cache keeps every token it has seen before and loads it back when a prompt repeats a system "
        "prompt a document a chat turn memory disk redis chunk block layer page tier request scheduler "
        "worker model output token prefix hash lease slot arena copy save load alpha beta gamma delta "
        "epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi "
        "omega one two three four five six seven eight nine ten"
    ).split()
)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a generated Llama; KV bytes per token = 2 * layers * kv_heads * head_dim * 2 (bf16)."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 1234

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes in bf16."""
        return self.kv_bytes_per_token_of(2)

    def kv_bytes_per_token_of(self, itemsize: int) -> int:
        """Bytes of KV one token takes with elements of itemsize bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


TINY = ModelShape()
# At least 16 KiB of KV per token, for the TTFT benchmark: 8 layers x 8 KV heads x 64 x 2 x 2 B = 16 KiB.
BENCH = ModelShape(
    num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64, intermediate_size=1024
)
# Long contexts: each layer's KV per token is Llama-3-8B's and -70B's (8 KV heads x 128, 4 KiB in
# bf16); two thin layers keep a 32k-token prefill to tens of seconds on the CPU build.
LONG = ModelShape(
    num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=128, intermediate_size=512,
    max_position_embeddings=131072,
)  # fmt: skip


def _corpus() -> list[str]:
    lines = []
    for i in range(400):
        words = [WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(12 + i % 9)]
        lines.append(" ".join(words) + f" {i}.")
    return lines


def _train_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    # A plain chat template so the OpenAI chat endpoint works with the tiny model.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(path))


def build_model(path: str | Path, shape: ModelShape = TINY) -> Path:
    """Write a random-weight Llama and its tokenizer to path (reused when already built)."""
    out = Path(path)
    marker = out / "kvtier-shape.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(shape):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out, shape.vocab_size)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights make the random model's greedy choices depend strongly on its KV,
    # so corrupted KV changes the output (the negative control needs that).
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    # transformers types `to` through a decorator that mypy reads as taking a model, not a dtype.
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)  # type: ignore[arg-type]
    marker.write_text(json.dumps(asdict(shape)))
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_lora_adapter(path: str | Path, shape: ModelShape = TINY, seed: int = 1, rank: int = 8) -> Path:
    """Write a random LoRA adapter for a model of this shape, in PEFT's layout (no peft needed).

    PEFT starts lora_B at zero, which would leave the model unchanged; here both matrices are random
    and large enough that an adapter changes the keys and values of every layer, and greedy outputs.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    # (input width, output width) of each target projection.
    widths = {
        "q_proj": (shape.hidden_size, q_width),
        "k_proj": (shape.hidden_size, kv_width),
        "v_proj": (shape.hidden_size, kv_width),
        "o_proj": (q_width, shape.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for name in LORA_TARGETS:
            d_in, d_out = widths[name]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * 0.2
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# Random models of the attention families kvtier serves besides dense Llama. Each is the smallest shape
# that keeps its family's structure on vLLM's CPU build, and reused once built (a marker holds its facts).

# DeepSeek-V2's MLA: the CPU MLA backend takes only DeepSeek's latent head (kv_lora_rank 512 +
# qk_rope_head_dim 64); every layer dense (first_k_dense_replace = layers), as MoE layers trip the CPU router.
MLA_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    first_k_dense_replace=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    max_position_embeddings=4096,
)

# Gemma 3: sliding-window layers around a full-attention one, a window shorter than the test prompts.
GEMMA3_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=64,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=4096,
)

# Granite 4 (GraniteMoeHybrid): Mamba-2 layers and one attention layer, a dense MLP (no experts).
GRANITE_HYBRID_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    shared_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    num_local_experts=0,
    layer_types=["mamba", "attention"],
    mamba_n_heads=4,
    mamba_d_head=64,
    mamba_d_state=64,
    mamba_n_groups=1,
    mamba_chunk_size=64,
    max_position_embeddings=4096,
)


def _build_random(path: str | Path, arch: str, config: dict[str, Any], std: float, seed: int = 1234) -> Path:
    """Write a random-weight model of transformers' `arch` (e.g. "DeepseekV2") with the tiny tokenizer."""
    out = Path(path)
    marker = out / "kvtier-shape.json"
    facts = {"arch": arch, "config": config, "std": std, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == facts:
        return out
    import torch
    import transformers

    config_cls = getattr(transformers, f"{arch}Config")
    if not hasattr(transformers, f"{arch}ForCausalLM"):
        arch = arch.removesuffix("Text")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out, int(config["vocab_size"]))
    hf_config = config_cls(
        **config, bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False
    )
    torch.manual_seed(seed)
    model = model_cls(hf_config)
    # Weights large enough that greedy choices depend strongly on the KV (outputs vary, and
    # corrupted KV would change them), small enough that the layers do not saturate.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith("bias"):
                param.normal_(0.0, std)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(facts))
    return out


def build_mla_model(path: str | Path) -> Path:
    """Write a random-weight DeepSeek-V2-shaped (MLA) model and its tokenizer (reused when built)."""
    return _build_random(path, "DeepseekV2", MLA_CONFIG, std=0.08)


def build_gemma3_model(path: str | Path) -> Path:
    """Write a random-weight Gemma-3-shaped sliding-window hybrid and its tokenizer (reused when built)."""
    return _build_random(path, "Gemma3Text", GEMMA3_CONFIG, std=0.08)


def build_granite_hybrid_model(path: str | Path) -> Path:
    """Write a random-weight Granite-4-shaped (Mamba-2 + attention) hybrid (reused when built)."""
    return _build_random(path, "GraniteMoeHybrid", GRANITE_HYBRID_CONFIG, std=0.08)

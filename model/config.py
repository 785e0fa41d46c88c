"""Shapes of a GPT model and the arithmetic that follows from them (parameters, FLOPs).

Plain dataclass (no framework imports) so the model stays usable on its own; the training config
(`training/config.py`) nests it as its `model` section.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class GPTConfig:
    n_layer: int = 2  # transformer blocks
    d_model: int = 128  # residual width
    n_head: int = 4  # query heads; head_dim = d_model // n_head
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention); None = n_head
    vocab_size: int = 50304  # embedding rows; >= the tokenizer's vocab (GPT-2's 50257 padded to 64·k)
    seq_len: int = 256  # context length in tokens
    mlp_ratio: int = 4  # MLP hidden = mlp_ratio · d_model
    pos_emb: str = "learned"  # learned | rope
    rope_theta: float = 10000.0  # rotary base (pos_emb=rope only)
    norm_eps: float = 1e-5  # LayerNorm epsilon
    bias: bool = True  # biases in linear layers and LayerNorm (GPT-2/3 style)
    dropout: float = 0.0  # on attention output and MLP output
    init_std: float = 0.02  # std of weights; residual projections scaled by 1/sqrt(2·n_layer)
    # auto | flash (our kernel) | sdpa | sdpa_flash / sdpa_cudnn (SDPA held to that one backend) | math
    # (scores materialised, softmax in fp32: "without FlashAttention") | reference (fp32, for checking)
    attention: str = "auto"
    # Local (sliding-window) attention, GPT-3's "alternating dense and locally banded sparse attention
    # patterns": attention_window = w tokens (0 = every layer dense). A local layer's token t attends to
    # tokens t - w + 1 .. t (itself and the w - 1 before it; inside its own document with packed
    # documents), i.e. window_size=(w - 1, 0) with causal=True in the kernels' convention (docs/kernels.md).
    # A window >= seq_len is the same as dense.
    attention_window: int = 0
    # which layers (0-based) are local when attention_window > 0: odd (1, 3, 5, ...: GPT-3's alternation,
    # the first layer dense) | even (0, 2, 4, ...) | all
    attention_window_layers: str = "odd"
    # recompute_attention: the attention keeps only q, k, v and runs its forward again in the backward
    # (torch.utils.checkpoint around the attention call): what lets `math` fit at long context
    recompute_attention: bool = False
    mlp: str = "auto"  # auto | fused (GELU in cuBLASLt's GEMM epilogues, CUDA) | torch (model/mlp.py)
    fused_loss: bool = True  # head + cross-entropy in row chunks, never holding full fp32 logits
    # The residual stream's dtype under autocast: fp32 (the embedding's dtype; the blocks' bf16 outputs
    # are added in fp32, as nanoGPT / GPT-NeoX) or autocast (the autocast dtype, as Megatron-LM's
    # default fp32_residual_connection=False: half the bytes in every LayerNorm and residual add).
    # Under FSDP2 the embedding's forward copy is bf16, so the stream is bf16 either way.
    residual: str = "fp32"  # fp32 | autocast
    # Activation memory, for a micro-batch that would not fit otherwise (the training forward keeps ~17
    # d-units -- d_model bf16 values -- per token and layer; dev/saved_activations.py counts them):
    # recompute_gelu: the fused MLP keeps the GELU's input only; the backward's GELU pass, which reads
    # it anyway, writes the output again for the second projection's weight gradient (-4 units; one
    # more (tokens, 4d) write per layer). Fused MLP only (kernels/gelu_mlp.py).
    recompute_gelu: bool = False
    # recompute_gelu_layers (with recompute_gelu): how many blocks, the first ones, recompute; the others
    # keep their GELU output (4 units more each, no rebuild). -1 = all. Spends what memory a micro-batch
    # leaves over: 2.7B-8k at micro-batch 2 on one H100, 14 (18 blocks keep theirs) -> 84.0 GB and +0.45%;
    # on several GPUs NCCL's own ~1.6 GB leaves no room for that (bench/RESULTS.md).
    recompute_gelu_layers: int = -1
    # recompute_blocks: each block keeps only its input and runs its whole forward again in the backward
    # (activation checkpointing, torch.utils.checkpoint around every block): ~1 unit per token and block
    # instead of ~17, for one more forward pass (~1/3 more compute, uncounted in model FLOPs). The longest
    # windows (bench/long_context.sh); it supersedes recompute_attention (one recomputation, not two).
    recompute_blocks: bool = False
    # norm_saves_output: the blocks' LayerNorms keep their (bf16) output, which the next projection
    # keeps anyway, instead of their input too; the backward recovers x_hat = (y - bias) / weight (-2
    # units, no extra pass). Needs LayerNorm gains away from zero (model/layernorm.py).
    norm_saves_output: bool = False
    # fused_add_norm (with norm_saves_output): each residual add and the LayerNorm after it run as one op
    # of ours each way (kernels/add_layer_norm.py; a block's last add is carried into the next block's
    # first LayerNorm): what torch.compile's LayerNorm backward and its weight-gradient sums cost less.
    # Kernels on CUDA for a 16-bit residual stream (model.residual=autocast); torch ops elsewhere.
    fused_add_norm: bool = False

    def recomputes_gelu(self, layer: int) -> bool:
        """Whether block `layer` (0-based) keeps only its GELU's input (recompute_gelu[_layers])."""
        if not self.recompute_gelu:
            return False
        return self.recompute_gelu_layers < 0 or layer < self.recompute_gelu_layers

    def window_of(self, layer: int) -> int:
        """Block `layer`'s (0-based) attention window in tokens; 0 = dense (attention_window[_layers])."""
        if self.attention_window <= 0:
            return 0
        local = {"all": True, "odd": layer % 2 == 1, "even": layer % 2 == 0}.get(self.attention_window_layers)
        if local is None:
            raise ValueError(f"model.attention_window_layers={self.attention_window_layers!r} is not one of odd, "
                             f"even, all")
        return self.attention_window if local else 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def num_params(self) -> int:
        """All parameters, counting the tied embedding/head matrix once."""
        d, L, b = self.d_model, self.n_layer, int(self.bias)
        kv_dim = self.kv_heads * self.head_dim
        hidden = self.mlp_ratio * d
        norm = d * (1 + b)  # LayerNorm weight (+ bias)
        attn = d * (d + 2 * kv_dim) + b * (d + 2 * kv_dim) + d * d + b * d  # qkv + out projection
        mlp = d * hidden + b * hidden + hidden * d + b * d
        block = 2 * norm + attn + mlp
        embed = self.vocab_size * d + (self.seq_len * d if self.pos_emb == "learned" else 0)
        return embed + L * block + norm  # + final LayerNorm

    def flops_per_token(self, causal_aware: bool = False) -> float:
        """Training FLOPs per token (forward + backward), the FlashAttention-2 paper's formula.

        Per sequence of s tokens: 6·s·N + 12·L·d·s²  (§4.2 of Dao 2023, also nanoGPT, torchtitan),
        i.e. per token 6·N + 12·L·d·s, with N all parameters and attention counted as if
        non-causal. `causal_aware=True` halves the attention term (Megatron's convention):
        6·N + 6·L·d·s.
        A local layer (window w < s, see window_of) attends w keys per query: 12·d·w in the paper's
        convention; causal-aware, the mean keys a query actually sees, w - w²/(2s) (w = s gives s/2).
        """
        d, s = self.d_model, self.seq_len
        keys = 0.0  # keys per query summed over layers
        for layer in range(self.n_layer):
            w = self.window_of(layer)
            if 0 < w < s:
                keys += w - w * w / (2 * s) if causal_aware else w
            else:
                keys += s / 2 if causal_aware else s
        return 6 * self.num_params() + 12 * d * keys

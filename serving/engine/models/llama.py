"""The Llama family (Llama 2/3, Mistral, Qwen2): the model, its HF -> engine weight names, its config reader.

In the layout of pytorch-labs/gpt-fast: fused `wqkv` and `w13` projections, rotary embeddings in the Hugging Face
"rotate half" layout (so HF weights need no permutation). The layer computation is written twice, on purpose:
`TransformerBlock.forward` / `Transformer.forward(tokens [B, S])` is the reference (whole sequences from position
0, causal, no cache: the plain computation the serving steps are tested against), and `TransformerBlock.step` /
`Transformer.step(tokens [T], ctx)` is what serves, over the paged KV cache: every serving step runs it, and its
`model.StepContext` (the attention metadata) decides the attention path and how the layers multiply
(`step.MixedStep`: prompt chunks and decodes packed; `cuda_graphs.DecodeStep`: one token a row under CUDA graphs).

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import silu_mul
from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.linear_float import FloatLinear, RowParallelLinear, TiedHead
from serving.engine.linear_quantized import prescale_rows_for
from serving.engine.model import (
    SUPPORTED_ROPE_TYPES,
    ModelArgs,
    RMSNorm,
    StepContext,
    apply_rope,
    layer_rope,
    rope_cos_sin,
    windows_of_layer_types,
)
from serving.engine.options import EngineOptions
from serving.engine.parallel import SINGLE, ParallelConfig, VocabParallelEmbedding, column_groups
from serving.engine.prefill_attention import causal_band

# HF name -> (engine name, part index, number of parts); `{i}` is the layer index.
HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", 0, 1),
    "model.norm.weight": ("norm.weight", 0, 1),
    "lm_head.weight": ("output.weight", 0, 1),
    "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.attention.wqkv.weight", 0, 3),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.attention.wqkv.weight", 1, 3),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.attention.wqkv.weight", 2, 3),
    "model.layers.{i}.self_attn.q_proj.bias": ("layers.{i}.attention.wqkv.bias", 0, 3),
    "model.layers.{i}.self_attn.k_proj.bias": ("layers.{i}.attention.wqkv.bias", 1, 3),
    "model.layers.{i}.self_attn.v_proj.bias": ("layers.{i}.attention.wqkv.bias", 2, 3),
    "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.attention.wo.weight", 0, 1),
    "model.layers.{i}.self_attn.o_proj.bias": ("layers.{i}.attention.wo.bias", 0, 1),
    "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.feed_forward.w13.weight", 0, 2),
    "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.feed_forward.w13.weight", 1, 2),
    "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.feed_forward.w2.weight", 0, 1),
    "model.layers.{i}.input_layernorm.weight": ("layers.{i}.attention_norm.weight", 0, 1),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.ffn_norm.weight", 0, 1),
}
IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
QKV_BIAS_BY_DEFAULT = frozenset({"Qwen2ForCausalLM"})  # q/k/v carry a bias whatever `attention_bias` says


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """The `ModelArgs` of an HF `config.json` dict of this family (`architecture`: its registry entry's name);
    options the engine does not implement raise `UnsupportedArchitectureError` naming them."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act={act!r} in {source}: only 'silu' is supported")
    if config.get("mlp_bias"):
        raise UnsupportedArchitectureError(f"mlp_bias=true in {source} is not supported")

    dim = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or dim // n_heads
    attention_bias = bool(config.get("attention_bias", False))

    # rope: transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`
    rope = dict(config.get("rope_parameters") or {})
    if not rope:
        rope = dict(config.get("rope_scaling") or {})
        rope["rope_theta"] = config.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} in {source} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )

    n_layers = int(config["num_hidden_layers"])
    sliding_window = config.get("sliding_window")
    if architecture == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
        sliding_window = None
    if sliding_window is not None and int(sliding_window) < 1:
        raise UnsupportedArchitectureError(f"sliding_window={sliding_window!r} in {source} must be >= 1 (or null)")
    layer_windows: tuple[int | None, ...] = ()
    types = config.get("layer_types")  # Qwen2's and Qwen3's; Mistral windows every layer, whatever layer_types
    if types is None and architecture == "Qwen2ForCausalLM":  # transformers' rule for configs before layer_types
        types = ["sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
                 for i in range(n_layers)]
    if sliding_window and types is not None and architecture != "MistralForCausalLM":
        try:
            layer_windows = windows_of_layer_types(types, int(sliding_window), n_layers, source=source)
        except ValueError as e:
            raise UnsupportedArchitectureError(str(e)) from None
    return ModelArgs(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        intermediate_size=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        qkv_bias=architecture in QKV_BIAS_BY_DEFAULT or attention_bias,
        o_bias=attention_bias,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        layer_windows=layer_windows,
    )


def engine_param_names(args: ModelArgs) -> list[str]:
    """Every tensor name an engine checkpoint of `args` must hold."""
    names = ["tok_embeddings.weight", "norm.weight"]
    if not args.tie_word_embeddings:
        names.append("output.weight")
    for i in range(args.n_layers):
        p = f"layers.{i}."
        names += [p + "attention.wqkv.weight", p + "attention.wo.weight", p + "feed_forward.w13.weight",
                  p + "feed_forward.w2.weight", p + "attention_norm.weight", p + "ffn_norm.weight"]
        if args.qkv_bias:
            names.append(p + "attention.wqkv.bias")
        if args.o_bias:
            names.append(p + "attention.wo.bias")
    return names


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, parallel: ParallelConfig = SINGLE) -> None:
        """`args`: this rank's (`ParallelConfig.shard_args`); wo's partial products are summed over the ranks."""
        super().__init__()
        self.args, self.parallel = args, parallel
        self.window: int | None = None  # this layer's sliding window (set by `Transformer`; None: global)
        self.wqkv = FloatLinear(args.dim, args.qkv_size, bias=args.qkv_bias)
        self.wo = RowParallelLinear(args.q_size, args.dim, bias=args.o_bias, groups=column_groups(args))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference attention: causal over the whole sequences, no cache. x: [B, S, D]; cos, sin: [B, S, hd]."""
        a = self.args
        bsz, seqlen, _ = x.shape
        q, k, v = (t.view(bsz, seqlen, -1, a.head_dim) for t in self.wqkv(x).split([a.q_size, a.kv_size, a.kv_size],
                                                                                   dim=-1))
        q, k = self.norm_heads(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, S, H, hd], [B, S, Hkv, hd]
        band = causal_band(seqlen, self.window, x.device)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=band is None, attn_mask=band, scale=a.softmax_scale,
                                           enable_gqa=a.n_heads != a.n_kv_heads)  # [B, H, S, hd]
        return self.parallel.all_reduce(self.wo(y.transpose(1, 2).reshape(bsz, seqlen, a.q_size)))

    def qkv(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The serving step's q/k/v of the normed rows h [T, D] -> [T, (H + 2 Hkv) hd], as `StepContext.attend`
        takes them (before the rotary embedding)."""
        return ctx.linear(self.wqkv, h)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., H, hd] and k [..., Hkv, hd] before the rotary embedding: as they are here (a family that norms
        each head, as Qwen3 does, overrides this)."""
        return q, k


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, parallel: ParallelConfig = SINGLE) -> None:
        super().__init__()
        self.intermediate_size, self.parallel = args.intermediate_size, parallel
        self.w13 = FloatLinear(args.dim, 2 * args.intermediate_size, bias=False)  # [gate; up]
        self.w2 = RowParallelLinear(args.intermediate_size, args.dim, bias=False, groups=column_groups(args))

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        return self.parallel.all_reduce(self.w2(self.gated(x, pdl), pdl=pdl))

    def gated(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """silu(gate) * up, the input of w2 (w13's `gated`: one kernel where it picked one); its rows scaled to
        e4m3 as well where w2's FP8 GEMM would scale them in a kernel of its own (`prescale_rows_for`)."""
        return self.w13.gated(x, pdl, e4m3=prescale_rows_for(self.w2, x.numel() // x.shape[-1], x.device))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP through its layers' dequantizing references."""
        return self.parallel.all_reduce(self.w2.reference(self.activation(self.w13.reference(x))))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """w13's output [..., 2I] -> silu(gate) * up [..., I] (a family of another activation overrides this and
        `gated`: `models.gemma3`)."""
        return silu_mul.gated(gate_up, self.intermediate_size)


class TransformerBlock(nn.Module):
    """One layer. A family that differs sets its own parts here (`models.qwen3`: its attention; `models.gemma3`: its
    attention, MLP and norms, and norms on the attention's and the MLP's outputs through `attention_output` and
    `mlp_output`, fused with the residual adds in a step through `add_attention_output` and `add_mlp_output`): both
    paths below run them, chosen when the model is built."""

    attention_class: type[Attention] = Attention
    feed_forward_class: type[FeedForward] = FeedForward  # the dense MLP
    norm_class: type[nn.Module] = RMSNorm  # the layers' norms and the model's final one

    def __init__(self, args: ModelArgs, feed_forward: nn.Module | None = None,
                 parallel: ParallelConfig = SINGLE) -> None:
        """`feed_forward`: the layer's MLP when not the dense one (a mixture of experts: `models.moe`)."""
        super().__init__()
        self.attention = self.attention_class(args, parallel)
        self.feed_forward = self.feed_forward_class(args, parallel) if feed_forward is None else feed_forward
        self.attention_norm = self.norm_class(args.dim, args.norm_eps)
        self.ffn_norm = self.norm_class(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference layer: x [B, S, D], whole sequences, no cache."""
        h = x + self.attention_output(self.attention(self.attention_norm(x), cos, sin))
        return h + self.mlp_output(self.feed_forward(self.ffn_norm(h)))

    def step(self, index: int, x: torch.Tensor, h: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer (number `index`) in a serving step: x [T, D] and h = its attention norm of x -> (x plus the
        attention output, the MLP's raw output ff). The caller adds ff (`add_mlp_output`) with the next norm in one
        pass."""
        y = ctx.attend(index, self.attention.qkv(h, ctx))  # [T, H hd]
        o = self.attention.parallel.all_reduce(ctx.linear(self.attention.wo, y))
        x, h = self.add_attention_output(x, o, ctx)
        ff = self.feed_forward.reference(h) if ctx.reference else self.feed_forward(h, ctx.pdl)
        return x, ff

    def add_attention_output(self, x: torch.Tensor, o: torch.Tensor, ctx: StepContext
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """A serving step's residual add of the attention output o and the MLP's norm: (x + attention_output(o), its
        `ffn_norm`), in one kernel on eager GPU work (a family whose output norm fuses with them overrides this)."""
        return self.ffn_norm.add(x, self.attention_output(o), pdl=ctx.pdl, e4m3=ctx.w13_e4m3)

    def add_mlp_output(self, x: torch.Tensor, ff: torch.Tensor, next_norm: nn.Module, ctx: StepContext
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `add_attention_output`, of the MLP output ff and the next layer's attention norm `next_norm`."""
        return next_norm.add(x, self.mlp_output(ff), pdl=ctx.pdl, e4m3=ctx.qkv_e4m3)

    def attention_output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention's output [..., D] as the residual stream adds it: as it is here."""
        return o

    def mlp_output(self, ff: torch.Tensor) -> torch.Tensor:
        """The MLP's output [..., D] as the residual stream adds it: as it is here."""
        return ff


def embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its random init where the weights are on the meta device (an engine about to load
    its own): normal_ on meta runs a python decomposition that imports torch._dynamo, 2.5 s of CPU in every
    process that loads an engine (each Triton `llm` stub), where nothing else would import it."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
    return nn.Embedding(vocab_size, dim)


class Transformer(nn.Module):
    """Embeddings, `n_layers` blocks, final norm, LM head (the embedding matrix when tied). With a `parallel`
    group of several ranks, this rank's shard of each (`serving.engine.parallel`); `args` is then this rank's."""

    block_class: type[TransformerBlock] = TransformerBlock  # a family's own layer (`models.qwen3`)

    def __init__(self, args: ModelArgs, parallel: ParallelConfig = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.args = args = parallel.shard_args(args)
        self.tok_embeddings = (embedding(args.vocab_size, args.dim) if parallel.size == 1
                               else VocabParallelEmbedding(args.vocab_size, args.dim, parallel))
        self.layers = nn.ModuleList(self.block(args, i) for i in range(args.n_layers))
        for i, layer in enumerate(self.layers):  # the reference forward's windows (the steps read `args`)
            layer.attention.window = args.window(i)
        self.norm = self.block_class.norm_class(args.dim, args.norm_eps)
        self.output = None if args.tie_word_embeddings else FloatLinear(args.dim, parallel.vocab_shard(args.vocab_size),
                                                                         bias=False)
        # the tied LM head over the embedding table (a tuple: not a submodule, the state dict holds the table once)
        self.tied_head = (TiedHead(self.tok_embeddings),) if args.tie_word_embeddings else ()
        self.options = EngineOptions()  # how it runs (`linears.apply_options` sets them at load)

    def block(self, args: ModelArgs, index: int) -> TransformerBlock:
        """Layer number `index` (a family's that differs by layer, a mixture of experts', builds its own)."""
        return self.block_class(args, parallel=self.parallel)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> their embeddings [..., D] (a family that scales them overrides this: `models.gemma3`)."""
        return self.tok_embeddings(tokens)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference forward (tests, the plain path the steps are checked against): tokens [B, S], each row
        a whole sequence from position 0, causal (banded on a windowed layer), no cache -> final hidden states
        [B, S, D]. Each layer rotates by its rope (`model.layer_rope`: Gemma 3's windowed layers by their own)."""
        a, (bsz, seqlen), dtype = self.args, tokens.shape, self.tok_embeddings.weight.dtype

        def tables(local: bool) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rope_cos_sin(a, seqlen, tokens.device, local=local)
            return cos.to(dtype).expand(bsz, -1, -1), sin.to(dtype).expand(bsz, -1, -1)

        rope, local = tables(False), (tables(True) if a.local_rope_theta is not None else None)
        x = self.embed(tokens)  # [B, S, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, *layer_rope(a, i, rope, local))
        return self.norm(x)

    def step(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Every layer of one serving step over the KV cache: tokens [T] -> the final norm of the rows `ctx`
        returns [N, D] (`StepContext.last_hidden`). Each layer's residual add and the next layer's norm run in
        one pass (`RMSNorm.add`)."""
        x = self.embed(tokens)  # [T, D]
        layers = self.layers
        h = layers[0].attention_norm(x, pdl=ctx.pdl, e4m3=ctx.qkv_e4m3)
        for i, layer in enumerate(layers):
            x, ff = layer.step(i, x, h, ctx)
            if i + 1 < len(layers):
                x, h = layer.add_mlp_output(x, ff, layers[i + 1].attention_norm, ctx)
        return ctx.last_hidden(self.norm, x, layers[-1].mlp_output(ff))

    def head(self) -> nn.Module:
        """The LM head's layer: over the embedding matrix when tied."""
        return self.tied_head[0] if self.output is None else self.output

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> float32 logits [..., V], through the head's GEMM for h's rows."""
        return self.parallel.gather_vocab(self.head()(h).float(), self.args.vocab_size)

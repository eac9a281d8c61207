"""The model spec: everything megac needs to know about a model and a target.

A :class:`ModelSpec` is fully resolved (one :class:`LayerSpec` per layer) and
validated; every consumer (graph builder, passes, executors, loaders, server)
reads it and nothing else. Specs come from YAML (``megac.spec.loader``) or from
a Hugging Face ``config.json`` (``megac.spec.hf``); both end here.

Semantics, stated once (they are what transformers' ``Cohere2MoeForCausalLM``
and ``LlamaForCausalLM`` do, which are the references we must agree with):

* **Block.** ``parallel`` (Cohere2): ``h = norm_l(x); x = x + Attn(h) + FFN(h)``.
  ``sequential`` (Llama): ``x = x + Attn(norm1_l(x)); x = x + FFN(norm2_l(x))``.
  Final ``norm`` then the LM head; ``logits = (h @ W_lm^T) * logit_scale``.
  No embedding scaling in either family.
* **Norm.** RMSNorm only: ``w * (x * rsqrt(mean(x^2) + norm_eps))`` (computed in
  fp32, rounded to the activation dtype, then multiplied by ``w``).
* **Attention.** GQA, ``num_heads`` query heads share ``num_kv_heads`` KV heads
  (query head ``h`` uses KV head ``h // heads_per_kv``); scale
  ``head_dim ** -0.5``; no biases, no QK-norm. Q width is ``q_width``
  (= num_heads*head_dim, may differ from hidden_size); O-proj maps q_width →
  hidden_size.
* **Sliding window.** ``window`` is the number of keys a query sees, its own
  token included: query at position ``i`` sees keys ``j`` with
  ``i - window < j <= i`` (transformers' ``sliding_window`` semantics).
* **RoPE.** Applied to Q and K of the layers with ``rope: true`` only (others are
  NoPE), position = absolute token index, ``inv_freq[k] = rope_theta **
  (-2k/head_dim)`` for ``k < head_dim/2``.
  ``interleaved`` (Cohere, GPT-J): pair ``(x[2k], x[2k+1])`` rotates by angle
  ``pos*inv_freq[k]``. ``half`` (Llama, NeoX): pair ``(x[k], x[k+head_dim/2])``
  rotates by ``pos*inv_freq[k]``. Rotation: ``(a, b) -> (a*cos - b*sin,
  b*cos + a*sin)``.
* **FFN.** SwiGLU: ``down(silu(gate(h)) * up(h))``; dense layers have width
  ``dense_intermediate_size``; MoE layers see :class:`MoESpec`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from megac.errors import MegacError
from megac.spec.limits import dimension_problems, product_problems

#: bf16 elements per 16-byte vector: widths a kernel streams must be multiples.
VEC_ELEMS = 8

_CFG = ConfigDict(extra="forbid", frozen=True)


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


class LayerSpec(BaseModel):
    """One decoder layer: attention kind, RoPE or NoPE, dense or MoE FFN.

    ``window`` is the sliding window in keys (own token included); it is
    ``None`` exactly when ``attention == "full"``.
    """

    model_config = _CFG

    attention: Literal["full", "sliding"]
    window: int | None = None
    rope: bool
    ffn: Literal["dense", "moe"]

    @model_validator(mode="after")
    def _check_window(self) -> "LayerSpec":
        if self.attention == "full" and self.window is not None:
            raise ValueError(f"window: must be null for a full-attention layer (got {self.window})")
        if self.attention == "sliding":
            if self.window is None:
                raise ValueError("window: a sliding layer needs a window")
            if self.window < 1:
                raise ValueError(f"window: must be > 0 (got {self.window})")
        return self

    @property
    def kind(self) -> tuple[str, str, bool]:
        """``(attention, ffn, rope)``: layers of one kind lower identically."""
        return (self.attention, self.ffn, self.rope)


class MoESpec(BaseModel):
    """The routed experts of every MoE layer (no shared experts, no biases).

    Router rule (exactly transformers' ``Cohere2MoeTopKRouter``; the CPU
    executor must match it):

    1. ``logits = h @ W_router^T`` (``W_router``: ``[num_experts, hidden]``, no
       bias), per row.
    2. Select the ``top_k`` experts by **raw logit** (``torch.topk``; sigmoid is
       monotonic so this is also top-k by score). Ties: lower expert id first
       (what the Cohere megakernel does; ``torch.topk`` does not specify).
    3. Weights from the selected logits only:
       ``sigmoid``: ``w = sigmoid(logit)``; if ``renormalize``, ``w /= sum(w)``.
       ``softmax``: ``w = softmax(selected logits)`` in fp32 (a softmax over the
       k selected logits, which equals softmax-over-all-then-renormalise); the
       weights already sum to 1, so ``renormalize`` must be ``false`` (HF's
       ``norm_topk_prob`` is ignored for softmax).
    4. Weights are cast to the activation dtype; the layer output is
       ``sum_k w_k * expert_k(h)`` with ``expert(h) = down(silu(gate(h)) *
       up(h))`` of width ``expert_intermediate_size``.

    Precision in transformers (for bit-level comparisons in bf16): the logits
    come out of ``F.linear`` in the activation dtype (so top-k sees bf16-rounded
    logits), sigmoid runs in that dtype, softmax in fp32; each expert output is
    multiplied by its weight in the activation dtype and accumulated with
    ``index_add_`` in the activation dtype, in increasing expert id order.
    """

    model_config = _CFG

    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    expert_intermediate_size: int = Field(ge=1)
    router: Literal["sigmoid", "softmax"]
    renormalize: bool

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: top_k ({self.top_k}) > num_experts ({self.num_experts})")
        if self.expert_intermediate_size % VEC_ELEMS:
            raise ValueError(
                f"expert_intermediate_size: must be a multiple of {VEC_ELEMS} "
                f"(got {self.expert_intermediate_size})"
            )
        if self.router == "softmax" and self.renormalize:
            raise ValueError(
                "renormalize: must be false with router softmax (softmax weights already sum to 1)"
            )
        return self


class TargetSpec(BaseModel):
    """What we compile for: GPU, SM count, batch sizes, paging and attention
    split policy, context buckets."""

    model_config = _CFG

    gpu: Literal["h100", "h200"] = "h200"
    num_sms: int = Field(default=132, ge=1)
    #: Batch sizes to build a schedule for; normalised to sorted and unique.
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    #: Tokens per KV page (a power of two).
    kv_block_size: int = 64
    #: A row's KV span is split into ceil(span / attn_split_tokens) splits ...
    attn_split_tokens: int = Field(default=512, ge=1)
    #: ... capped at this many.
    attn_max_splits: int = Field(default=32, ge=1)
    #: Context lengths a schedule is built for (each at its upper bound).
    #: None: powers of two from 1024 up to max_context, always ending at
    #: max_context (see ModelSpec.resolved_context_buckets).
    context_buckets: list[int] | None = None
    #: Tile sizes for this target (keys of megac.geometry.DEFAULT_TILES, e.g.
    #: moe_up_bn, router_splits); unnamed ones keep their defaults. Clamped to
    #: the model's dimensions like the defaults.
    tiles: dict[str, int] | None = None

    @field_validator("tiles")
    @classmethod
    def _tiles(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        if v is None:
            return v
        from megac.geometry import DEFAULT_TILES

        for k, x in v.items():
            if k not in DEFAULT_TILES:
                raise ValueError(f"unknown tile {k!r} (known: {', '.join(sorted(DEFAULT_TILES))})")
            if k in ("fused_topk", "fused_gather", "fused_combine", "kv_head_major", "router_combine",
                     "qkv_combine", "up_combine", "moe_out_bf16"):
                if x not in (0, 1):
                    raise ValueError(f"{k} is 0 or 1 (got {x})")
            elif k == "o_proj_merge":
                if x not in (-1, 0, 1):
                    raise ValueError(f"{k} is 0, 1 or -1 (automatic: where split_down applies) (got {x})")
            elif k == "split_down":
                if not -1 <= x <= 65536:
                    raise ValueError(f"{k} is a row bound in 0..65536, 0: none, -1: automatic (got {x})")
            elif k in ("routed_claims", "norm_fold", "full_static_attn"):
                if not 0 <= x <= 65536:
                    raise ValueError(f"{k} is a row bound in 0..65536, 0: none (got {x})")
            elif k == "combine_splits":
                if not (x == -1 or 1 <= x <= 65536):
                    raise ValueError(f"{k} is 1..65536 tasks a row, -1: automatic (got {x})")
            elif k == "lm_bn":
                if not (x == -1 or 1 <= x <= 65536):
                    raise ValueError(f"{k} is 1..65536 vocab rows a tile, -1: automatic (got {x})")
            elif k == "routed_combine_splits":
                if not 0 <= x <= 65536:
                    raise ValueError(f"{k} is 0..65536 tasks a row, 0: as combine_splits (got {x})")
            elif k in ("split_up_bn", "split_o_proj_bn"):
                if not 0 <= x <= 65536:
                    raise ValueError(f"{k} must be in 0..65536, 0: as the plain schedules' tile (got {x})")
            elif not 1 <= x <= 65536:
                raise ValueError(f"{k} must be in 1..65536 (got {x})")
            if k in ("upgate_bn", "moe_up_bn", "split_up_bn") and x % 2:
                raise ValueError(f"{k} must be even: a tile holds gate and up rows in pairs (got {x})")
        return dict(sorted(v.items()))

    @field_validator("batch_sizes")
    @classmethod
    def _batch_sizes(cls, v: list[int]) -> list[int]:
        for b in v:
            if not 1 <= b <= 64:
                raise ValueError(f"each batch size must be in 1..64 (got {b})")
        return sorted(set(v))

    @field_validator("kv_block_size")
    @classmethod
    def _kv_block(cls, v: int) -> int:
        if not _is_pow2(v):
            raise ValueError(f"must be a power of two (got {v})")
        return v

    @field_validator("context_buckets")
    @classmethod
    def _buckets(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must not be empty (omit it or use null for the default)")
        for b in v:
            if b < 1:
                raise ValueError(f"each bucket must be >= 1 (got {b})")
        return sorted(set(v))


def derive_context_buckets(max_context: int) -> list[int]:
    """Powers of two from 1024 below max_context, then max_context itself."""
    out: list[int] = []
    b = 1024
    while b < max_context:
        out.append(b)
        b *= 2
    out.append(max_context)
    return out


class ModelSpec(BaseModel):
    """A fully resolved, validated model + target description."""

    model_config = _CFG

    name: str = Field(min_length=1)
    family: Literal["cohere2_moe", "llama"]
    block: Literal["parallel", "sequential"]

    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    q_width: int = Field(ge=1)

    layers: list[LayerSpec]

    rope_theta: float = Field(gt=0)
    rope_style: Literal["interleaved", "half"]
    norm_eps: float = Field(gt=0)

    dense_intermediate_size: int | None = Field(default=None, ge=1)
    moe: MoESpec | None = None

    vocab_size: int = Field(ge=1)
    tie_embeddings: bool
    logit_scale: float = 1.0
    eos_token_ids: list[int] = Field(default_factory=list)
    bos_token_id: int | None = None

    max_context: int = Field(ge=1)

    target: TargetSpec = Field(default_factory=TargetSpec)

    # ------------------------------------------------------------------ checks

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        for problem in _problems(self):
            raise ValueError(problem)
        return self

    # ------------------------------------------------------------- properties

    @property
    def heads_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width

    @property
    def dense_prefix_layers(self) -> int:
        """Leading dense layers of a model that has MoE (0 when it has none)."""
        if self.moe is None:
            return 0
        n = 0
        for layer in self.layers:
            if layer.ffn != "dense":
                break
            n += 1
        return n

    @property
    def layer_kinds(self) -> list[tuple[str, str, bool]]:
        """Distinct ``(attention, ffn, rope)`` combos, in order of first use."""
        seen: list[tuple[str, str, bool]] = []
        for layer in self.layers:
            if layer.kind not in seen:
                seen.append(layer.kind)
        return seen

    @property
    def resolved_context_buckets(self) -> list[int]:
        if self.target.context_buckets is not None:
            return list(self.target.context_buckets)
        return derive_context_buckets(self.max_context)

    def context_bucket(self, context_len: int) -> int:
        """The smallest context bucket >= context_len."""
        for b in self.resolved_context_buckets:
            if b >= context_len:
                return b
        raise MegacError(f"context length {context_len} exceeds max_context ({self.max_context})")

    @property
    def full_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.attention == "full"]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.attention == "sliding"]

    @property
    def rope_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.rope]

    @property
    def dense_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.ffn == "dense"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.ffn == "moe"]

    # ---------------------------------------------------------- param counts

    def _attn_params(self) -> int:
        return self.hidden_size * self.qkv_width + self.q_width * self.hidden_size

    def _norms_per_layer(self) -> int:
        return (2 if self.block == "sequential" else 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters (tied embeddings counted once)."""
        d = self.hidden_size
        n = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d  # + final norm
        for layer in self.layers:
            n += self._attn_params() + self._norms_per_layer()
            if layer.ffn == "dense":
                n += 3 * d * (self.dense_intermediate_size or 0)
            else:
                assert self.moe is not None
                n += self.moe.num_experts * (3 * d * self.moe.expert_intermediate_size + d)
        return n

    @property
    def num_active_params(self) -> int:
        """Parameters read per token: everything but the unselected experts and
        the embedding table (the LM head matrix is counted once)."""
        return int(self.params_read(self.moe.top_k if self.moe is not None else 0))

    def params_read(self, experts_per_layer: float) -> float:
        """Parameters a decode step reads with ``experts_per_layer`` experts of
        each MoE layer touched (may be fractional: an expected count): every
        layer's attention, norms, dense FFN or router, those experts, the
        final norm and the LM head; not the embedding table (its rows only,
        which the caller adds where they are not the tied LM head)."""
        d = self.hidden_size
        n = self.vocab_size * d + d
        for layer in self.layers:
            n += self._attn_params() + self._norms_per_layer()
            if layer.ffn == "dense":
                n += 3 * d * (self.dense_intermediate_size or 0)
            else:
                assert self.moe is not None
                n += self.moe.num_experts * d + experts_per_layer * 3 * d * self.moe.expert_intermediate_size
        return n

    def describe(self) -> str:
        """A few human-readable lines (for ``megac`` output)."""
        lines = [
            f"{self.name}: {self.family}, {self.block} block, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, {self.num_heads}/{self.num_kv_heads} heads of {self.head_dim} "
            f"(q width {self.q_width}), vocab {self.vocab_size}, max context {self.max_context}",
        ]
        for kind in self.layer_kinds:
            idx = [i for i, l in enumerate(self.layers) if l.kind == kind]
            attn, ffn, rope = kind
            lines.append(
                f"  {len(idx):3d} x {attn}/{ffn}/{'rope' if rope else 'nope'}: layers {_ranges(idx)}"
            )
        if self.moe is not None:
            m = self.moe
            lines.append(
                f"  moe: {m.num_experts} experts, top-{m.top_k}, width {m.expert_intermediate_size}, "
                f"{m.router}{' renormalized' if m.renormalize else ''}"
            )
        lines.append(
            f"  params: {_human(self.num_params)} total, {_human(self.num_active_params)} active"
        )
        return "\n".join(lines)


def _human(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _ranges(idx: list[int]) -> str:
    """``[0, 4, 8, 12]`` -> ``"0,4,...,12"``; ``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    if len(idx) >= 3:
        diffs = {b - a for a, b in zip(idx, idx[1:])}
        if len(diffs) == 1:
            d = diffs.pop()
            return f"{idx[0]}-{idx[-1]}" if d == 1 else f"{idx[0]},{idx[1]},...,{idx[-1]}"
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _problems(s: ModelSpec):
    """Yield consistency problems, each naming its field. The first one found is
    reported. Sizes (:mod:`megac.spec.limits`) come first, since an absurd size
    is the likeliest cause of any other complaint; the limits on products of
    sizes come last, as they need a consistent spec."""
    yield from dimension_problems(s)
    # Geometry.
    if s.num_heads * s.head_dim != s.q_width:
        yield f"q_width: num_heads*head_dim ({s.num_heads * s.head_dim}) != q_width ({s.q_width})"
    if s.num_heads % s.num_kv_heads:
        yield f"num_kv_heads: num_heads ({s.num_heads}) is not a multiple of num_kv_heads ({s.num_kv_heads})"
    if s.hidden_size % VEC_ELEMS:
        yield f"hidden_size: must be a multiple of {VEC_ELEMS} (got {s.hidden_size})"
    if s.head_dim % VEC_ELEMS:
        yield f"head_dim: must be a multiple of {VEC_ELEMS} (got {s.head_dim})"
    if s.dense_intermediate_size is not None and s.dense_intermediate_size % VEC_ELEMS:
        yield (f"dense_intermediate_size: must be a multiple of {VEC_ELEMS} "
               f"(got {s.dense_intermediate_size})")

    # Layers.
    if len(s.layers) != s.num_layers:
        yield f"layers: {len(s.layers)} layers given but num_layers is {s.num_layers}"
    for i, layer in enumerate(s.layers):
        if layer.window is not None and layer.window > s.max_context:
            yield f"layers[{i}].window: window ({layer.window}) > max_context ({s.max_context})"
    has_dense = any(l.ffn == "dense" for l in s.layers)
    has_moe = any(l.ffn == "moe" for l in s.layers)
    if has_moe and s.moe is None:
        yield f"moe: required (layer {s.moe_layers[0]} has ffn moe)"
    if not has_moe and s.moe is not None:
        yield "moe: given but no layer has ffn moe"
    if has_dense and s.dense_intermediate_size is None:
        yield f"dense_intermediate_size: required (layer {s.dense_layers[0]} has ffn dense)"
    if not has_dense and s.dense_intermediate_size is not None:
        yield "dense_intermediate_size: given but no layer has ffn dense"
    if any(l.rope for l in s.layers) and s.head_dim % 2:
        yield f"head_dim: must be even for RoPE (got {s.head_dim})"

    # Tokens.
    for t in s.eos_token_ids:
        if not 0 <= t < s.vocab_size:
            yield f"eos_token_ids: id {t} outside the vocabulary (0..{s.vocab_size - 1})"
    if s.bos_token_id is not None and not 0 <= s.bos_token_id < s.vocab_size:
        yield f"bos_token_id: id {s.bos_token_id} outside the vocabulary (0..{s.vocab_size - 1})"
    if not s.logit_scale > 0:
        yield f"logit_scale: must be > 0 (got {s.logit_scale})"

    # Target vs model.
    qkv_bn = (s.target.tiles or {}).get("qkv_bn")
    if qkv_bn is not None:
        from megac.geometry import qkv_tile_problem

        problem = qkv_tile_problem(min(qkv_bn, s.head_dim), s)
        if problem:
            yield problem
    cb = s.target.context_buckets
    if cb is not None:
        if cb[-1] > s.max_context:
            yield f"target.context_buckets: bucket {cb[-1]} > max_context ({s.max_context})"
        elif cb[-1] != s.max_context:
            yield f"target.context_buckets: the last bucket ({cb[-1]}) must equal max_context ({s.max_context})"

    # Family: what the reference implementation (transformers) can express.
    yield from _family_problems(s)

    # What one GPU could hold: weights, expert instances, page table.
    yield from product_problems(s)


def _family_problems(s: ModelSpec):
    if s.family == "llama":
        if s.block != "sequential":
            yield "block: family llama has a sequential block"
        if s.rope_style != "half":
            yield "rope_style: family llama uses rope_style half"
        for i, l in enumerate(s.layers):
            if l.attention != "full":
                yield f"layers[{i}].attention: family llama has only full-attention layers"
            if not l.rope:
                yield f"layers[{i}].rope: family llama applies RoPE on every layer"
            if l.ffn != "dense":
                yield f"layers[{i}].ffn: family llama has only dense layers"
        if s.logit_scale != 1.0:
            yield f"logit_scale: family llama has no logit scale (must be 1.0, got {s.logit_scale})"
    elif s.family == "cohere2_moe":
        if s.block != "parallel":
            yield "block: family cohere2_moe has a parallel block"
        if s.rope_style != "interleaved":
            yield "rope_style: family cohere2_moe uses rope_style interleaved"
        windows = {l.window for l in s.layers if l.attention == "sliding"}
        if len(windows) > 1:
            yield f"layers: family cohere2_moe has one sliding window for all sliding layers (got {sorted(windows)})"
        # transformers: rope = sliding or (dense and prefix_dense_sliding_window_pattern == 1).
        dense_full_rope: bool | None = None
        for i, l in enumerate(s.layers):
            if l.attention == "sliding" and not l.rope:
                yield f"layers[{i}].rope: family cohere2_moe applies RoPE on every sliding layer"
            if l.attention == "full" and l.ffn == "moe" and l.rope:
                yield f"layers[{i}].rope: family cohere2_moe has no RoPE on full-attention MoE layers"
            if l.attention == "full" and l.ffn == "dense":
                if dense_full_rope is None:
                    dense_full_rope = l.rope
                elif l.rope != dense_full_rope:
                    yield (f"layers[{i}].rope: family cohere2_moe gives all full-attention dense layers "
                           f"the same rope flag")


__all__ = [
    "LayerSpec",
    "MoESpec",
    "ModelSpec",
    "TargetSpec",
    "VEC_ELEMS",
    "derive_context_buckets",
]

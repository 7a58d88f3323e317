"""The decoder-only transformer that every supported family is, written once against a
backend's ops (interface.py).

Token embeddings go into a float32 residual stream; each layer adds its attention
sublayer's output and then its gated MLP's; the last token of each sequence goes
through the final norm and the LM head. What sets the families apart is data, read from
config.json into ModelConfig by the family's `read_config`: q/k/v biases, per-head q/k
norms, Gemma's (1 + w) norms and its norms on the sublayers' outputs, the gate's
activation, an embedding scale, the attention scale, a sliding window per layer, one RoPE
table per layer type, soft-capped scores and logits. A family's file (llama.py,
qwen2.py, ...) is a subclass that reads its config and names its checkpoint's tensors;
docs/ARCHITECTURE.md, "Adding a model", says how to write one.

One call of `forward` runs one step: the new tokens of every scheduled sequence (prefill
chunks and decode tokens alike) through all layers, writing their K/V into the paged
cache, and returns the logits of each sequence's last token. The step is a walk over
`pieces` (everything between two attentions) with each layer's `attention` between them
and `head` at the end; the CUDA backend captures the same pieces as graphs
(backends/cuda/graphs.py), so the layer order is written here only.
"""
from __future__ import annotations

from typing import Callable, ClassVar

import numpy as np

from ..config import ConfigReader, ModelConfig
from ..interface import AddedNorm, Backend, ForwardBatch, HeadNorm
from ..weights import SCALE_SUFFIX, BlobEntry, LayoutItem, layout_blob, scale_key
from .rope import rope_table

# a layer's tensors by role: the checkpoint names after "model.layers.{i}.", several where
# the blob lays them side by side as one matrix (q/k/v, gate/up)
LLAMA_LAYER_TENSORS = {
    "input_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "o_proj": ("self_attn.o_proj.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),   # the MLP's input norm in Llama
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
# the roles of the products, whose weights may be FP8 (docs/ARCHITECTURE.md, "FP8 weights")
PRODUCT_ROLES = ("qkv", "o_proj", "gate_up", "down")


PROMPT_PIECE_ROWS = 256  # prompt rows per LM-head product where the backend sets no score_rows


class Decoder:
    """A model of one family: its config, its weight plan, its activation buffers, its
    RoPE tables and its forward pass. Subclasses set the class attributes and read_config."""
    architectures: ClassVar[tuple[str, ...]] = ()  # config.json architectures it runs
    model_types: ClassVar[tuple[str, ...]] = ()    # and model_type, when architectures is absent
    layer_tensors: ClassVar[dict[str, tuple[str, ...]]] = LLAMA_LAYER_TENSORS

    def __init__(self, config: ModelConfig):
        self.config = config

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        """config.json (and generation_config.json) as this family reads them: what it
        needs, what it refuses (ConfigError naming the field)."""
        raise NotImplementedError

    # ---- weights -----------------------------------------------------------------------
    def checkpoint_names(self, tensors: dict) -> dict:
        """The checkpoint's tensors under the names the weight plan reads (a family whose
        checkpoints name them otherwise renames them here, and leaves out what it does not
        run); as they are by default."""
        return tensors

    def layer_roles(self) -> list[str]:
        """The roles of a layer's weights, in checkpoint order."""
        c = self.config
        roles = ["input_norm", "qkv"]
        roles += ["qkv_bias"] if c.qkv_bias else []
        roles += ["q_norm", "k_norm"] if c.qk_norm else []
        roles += ["o_proj"]
        roles += ["attn_out_norm"] if c.sandwich_norms else []
        roles += ["mlp_norm", "gate_up", "down"]
        roles += ["mlp_out_norm"] if c.sandwich_norms else []
        return roles

    def _role_shapes(self, role: str) -> list[tuple[int, ...]]:
        """The shape of each tensor of a role (layer_tensors' names, in order)."""
        c = self.config
        H, I, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
        return {"input_norm": [(H,)], "attn_out_norm": [(H,)], "mlp_norm": [(H,)],
                "mlp_out_norm": [(H,)], "qkv": [(q, H), (kv, H), (kv, H)],
                "qkv_bias": [(q,), (kv,), (kv,)], "q_norm": [(c.head_dim,)],
                "k_norm": [(c.head_dim,)], "o_proj": [(H, q)], "gate_up": [(I, H), (I, H)],
                "down": [(H, I)]}[role]

    def weight_layout(self) -> list[LayoutItem]:
        """The blob's entries in blob order: each key, the checkpoint tensors laid side by
        side under it, its shape and format. With FP8 products each product's entry holds
        its e4m3 codes and is followed by its scales' (weights.scale_key), read from the
        checkpoint's "..._scale" tensors or made at load from bf16 weights."""
        c, shapes = self.config, self._checkpoint_shapes()

        def item(key, sources):
            rows = sum(shapes[s][0] for s in sources)   # fused along dim 0
            return LayoutItem(key, sources, (rows,) + shapes[sources[0]][1:])

        layout = [item("embed", ("model.embed_tokens.weight",))]
        for i in range(c.num_hidden_layers):
            prefix = f"model.layers.{i}."
            for role in self.layer_roles():
                entry = item(f"layers.{i}.{role}", tuple(prefix + n for n in self.layer_tensors[role]))
                if c.quantization is None or role not in PRODUCT_ROLES:
                    layout.append(entry)
                    continue
                made = c.checkpoint_quantization is None  # quantized at load
                scales = () if made else tuple(n + SCALE_SUFFIX for n in entry.sources)
                layout += [entry._replace(dtype="e4m3", quantize=made),
                           LayoutItem(scale_key(entry.key), scales, entry.shape[:1], "f32", made)]
        layout.append(item("final_norm", ("model.norm.weight",)))
        if not c.tie_word_embeddings:
            layout.append(item("lm_head", ("lm_head.weight",)))
        return layout

    def fp8_tensors(self) -> list[str]:
        """The checkpoint tensors an FP8 checkpoint stores as e4m3: every product's weights."""
        return [f"model.layers.{i}.{name}" for i in range(self.config.num_hidden_layers)
                for role in self.layer_roles() if role in PRODUCT_ROLES
                for name in self.layer_tensors[role]]

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's weights by checkpoint name and shape, in checkpoint order."""
        c = self.config
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_hidden_layers):
            for role in self.layer_roles():
                for name, shape in zip(self.layer_tensors[role], self._role_shapes(role)):
                    shapes[f"model.layers.{i}.{name}"] = shape
        shapes["model.norm.weight"] = (c.hidden_size,)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        return shapes

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the model reads and its shape, in checkpoint order; an
        FP8 checkpoint's weight scales as [N, 1] (open_checkpoint also takes [N] and
        per-tensor scales)."""
        shapes = self._checkpoint_shapes()
        if self.config.checkpoint_quantization is None:
            return shapes
        scales = {name + SCALE_SUFFIX: (shapes[name][0], 1) for name in self.fp8_tensors()}
        return {**shapes, **scales}

    def weight_plan(self) -> tuple[dict[str, BlobEntry], int]:
        """The one weight blob (docs/ARCHITECTURE.md, Decisions 2): entries by key, and its
        size in bytes."""
        return layout_blob(self.weight_layout())

    # ---- memory ------------------------------------------------------------------------
    def buffer_shapes(self, num_tokens: int, num_seqs: int) -> dict[str, tuple]:
        """Activation buffers of one step, name -> shape for T tokens and B sequences.
        The CUDA backend carves them out of one pool planned from max_num_batched_tokens
        and max_num_seqs; `qkv`/`gate_up` and `q`/`act` never live at the same time, so
        each pair may share memory. `h`, `qkv`, `gate_up` and `last_h` are scratch of the
        composed sublayer ops (interface.py SublayerOps); `h` also takes a sublayer's
        output before its norm where the family has sandwich norms, and `residual_mid`
        the stream between a layer's two sublayers (attention_out_and_mlp)."""
        c = self.config
        T, B, H = num_tokens, num_seqs, c.hidden_size
        mid = {"residual_mid": (T, H)} if c.sandwich_norms else {}  # float32
        return mid | {
            "residual": (T, H),               # the residual stream (float32 on every backend)
            "h": (T, H),                      # normalized input (or raw output) of a sublayer
            "qkv": (T, c.q_size + 2 * c.kv_size),  # fused projection output
            "q": (T, c.num_attention_heads, c.head_dim),  # rotated queries
            "attn": (T, c.q_size),            # attention output, heads concatenated
            "gate_up": (T, 2 * c.intermediate_size),
            "act": (T, c.intermediate_size),
            "last_h": (B, H),                 # each sequence's last hidden state
            "last_residual": (B, H),          # and its residual stream (float32)
            "logits": (B, c.vocab_size),      # float32
        }

    def rope_tables(self, max_positions: int) -> dict:
        """Layer type -> [max_positions, head_dim] float32 cos/sin table; layer types with
        the same settings share one array."""
        tables, made = {}, {}
        for layer_type, rope in self.config.rope.items():
            if rope not in made:
                made[rope] = rope_table(rope, self.config.head_dim, max_positions)
            tables[layer_type] = made[rope]
        return tables

    # ---- the forward pass --------------------------------------------------------------
    def forward(self, backend: Backend, batch: ForwardBatch, prompt=None):
        """Logits [B, V] float32 (a backend array, a view of the pool). prompt: None, or an
        interface.PromptLogprobRequest, whose values and ids this fills."""
        return self.forward_uploaded(backend, backend.ops.upload(batch), prompt)

    def forward_uploaded(self, backend: Backend, meta, prompt=None):
        """forward() of a step whose metadata is already where the ops read it: `meta` is
        what ops.upload returned (CUDA graphs pass their fixed device buffers); the ops take
        it as it is, and the step's sizes are its num_tokens and num_seqs."""
        buf = backend.buffers(meta.num_tokens, meta.num_seqs)
        # the rows and targets go up before the layers are queued: an upload waits for
        # what its stream has queued already
        staged = None if prompt is None else backend.ops.device_array(
            np.stack([prompt.rows, prompt.targets]))
        pieces = self.pieces(backend, meta, buf)
        pieces[0]()
        for i in range(self.config.num_hidden_layers):
            self.attention(backend, meta, buf, i)
            pieces[i + 1]()
        if prompt is not None:
            self.prompt_logprobs(backend, meta, buf, prompt, staged)
        return self.head(backend, meta, buf)

    def prompt_logprobs(self, backend: Backend, meta, buf, prompt, staged) -> None:
        """The next-token log-probabilities at the rows prompt.rows: their logits in pieces
        of as many rows as the logits buffer holds (the backend's score_rows; one read of
        the LM head per piece), each piece reduced on the device to its targets' and top
        k's log-softmax (docs/ARCHITECTURE.md, "Prompt log-probabilities"). staged:
        [2, P] int32 in backend memory, prompt.rows over prompt.targets."""
        ops = backend.ops
        count, k = len(prompt.rows), prompt.k
        piece = getattr(backend, "score_rows", PROMPT_PIECE_ROWS)
        wide = backend.buffers(meta.num_tokens, piece)
        prompt.values = ops.empty((count, 1 + k), np.float32)
        prompt.ids = ops.empty((count, 1 + k), np.int32)
        prompt.ranks = ops.empty((count,), np.int32)
        rows, targets = staged[0], staged[1]
        for start in range(0, count, piece):
            stop = min(count, start + piece)
            logits = self.logits_of(backend, buf["residual"], rows[start:stop], wide)
            ops.token_logprobs(logits, targets[start:stop], k, prompt.values[start:stop],
                               prompt.ids[start:stop], prompt.ranks[start:stop])

    def logits_of(self, backend: Backend, residual, rows, buf):
        """The final norm and the LM head of residual[rows]: logits [len(rows), V] float32,
        in buf's logits (buf: buffers with room for that many sequences)."""
        c, ops, w = self.config, backend.ops, backend.weights
        n = rows.shape[0]
        ops.gather_rows(residual, rows, buf["last_residual"][:n])
        lm_head = w["lm_head"] if "lm_head" in w else w["embed"]  # tied embeddings
        logits = buf["logits"][:n]
        ops.norm_linear(buf["last_residual"][:n], w["final_norm"], c.rms_norm_eps, lm_head,
                        logits, buf["last_h"][:n], offset=c.norm_offset)
        if c.final_logit_softcap is not None:
            ops.softcap(logits, c.final_logit_softcap)
        return logits

    def pieces(self, backend: Backend, meta, buf) -> list[Callable[[], None]]:
        """What runs between two attentions, in order: the embedding and layer 0's
        attention_in; layer i's attention_out_and_mlp and layer i + 1's attention_in; the
        last layer's attention_out_and_mlp. Only `attention` depends on how a step's tokens
        split into sequences, so the CUDA backend captures each piece once per token
        count."""
        last = self.config.num_hidden_layers - 1

        def first():
            self.embed(backend, meta, buf)
            self.attention_in(backend, meta, buf, 0)

        def between(i):
            self.attention_out_and_mlp(backend, buf, i)
            self.attention_in(backend, meta, buf, i + 1)

        return ([first] + [lambda i=i: between(i) for i in range(last)]
                + [lambda: self.attention_out_and_mlp(backend, buf, last)])

    def embed(self, backend: Backend, meta, buf) -> None:
        backend.ops.embedding(meta.token_ids, backend.weights["embed"], buf["residual"],
                              scale=self.config.embed_scale)  # residual: [T, H] float32

    def attention_in(self, backend: Backend, meta, buf, i: int) -> None:
        """Layer i's norm, qkv product (and bias), q/k norms, RoPE and cache write: q
        [T, nh, d]. With sandwich norms, layer i - 1's MLP output joins the stream first."""
        c, w, layer = self.config, backend.weights, f"layers.{i}"
        k_cache, v_cache = backend.kv_caches[i]
        head_norm = (HeadNorm(w[f"{layer}.q_norm"], w[f"{layer}.k_norm"], c.rms_norm_eps,
                              c.norm_offset) if c.qk_norm else None)
        x, added = buf["residual"], None
        if c.sandwich_norms and i > 0:
            x, added = buf["residual_mid"], AddedNorm(
                buf["h"], w[f"layers.{i - 1}.mlp_out_norm"], buf["residual"])
        backend.ops.norm_qkv_rope(
            x, w[f"{layer}.input_norm"], c.rms_norm_eps, w[f"{layer}.qkv"], meta,
            backend.rope_tables[c.layer_types[i]], k_cache, v_cache, buf["q"], buf["h"],
            buf["qkv"], offset=c.norm_offset,
            bias=w[f"{layer}.qkv_bias"] if c.qkv_bias else None, head_norm=head_norm,
            added=added)

    def attention(self, backend: Backend, meta, buf, i: int) -> None:
        """Layer i's attention over the paged cache: attn [T, nh * d]."""
        k_cache, v_cache = backend.kv_caches[i]
        backend.ops.attention(buf["q"], k_cache, v_cache, meta, self.config.attn_scale,
                              buf["attn"], window=self.config.layer_window(i),
                              softcap=self.config.attn_logit_softcap)

    def attention_out_and_mlp(self, backend: Backend, buf, i: int) -> None:
        """Layer i's output product into the residual stream, then the MLP: norm, gate/up
        product and gated activation (act: [T, I]), and the down product likewise. Added
        straight into the float32 residual stream.

        With sandwich norms each product goes to `h` first, and its norm adds it as the next
        sublayer opens (interface.AddedNorm), so that a GPU kernel may do both: the
        attention output joins in norm_gate_up_act, into `residual_mid`; the MLP output
        joins in the next layer's attention_in, back into `residual` (after the last
        layer, here). The stream goes between two buffers because that kernel reads it in
        every block while one block writes the sum (docs/ARCHITECTURE.md, "Sandwich
        norms")."""
        c, ops, w, layer = self.config, backend.ops, backend.weights, f"layers.{i}"
        eps, offset = c.rms_norm_eps, c.norm_offset
        added = None
        if c.sandwich_norms:
            ops.linear(buf["attn"], w[f"{layer}.o_proj"], buf["h"])
            added = AddedNorm(buf["h"], w[f"{layer}.attn_out_norm"], buf["residual_mid"])
        else:
            ops.linear(buf["attn"], w[f"{layer}.o_proj"], buf["residual"], accumulate=True)
        ops.norm_gate_up_act(buf["residual"], w[f"{layer}.mlp_norm"], eps, w[f"{layer}.gate_up"],
                             buf["act"], buf["h"], buf["gate_up"], offset=offset,
                             act=c.hidden_act, added=added)
        if c.sandwich_norms:
            ops.linear(buf["act"], w[f"{layer}.down"], buf["h"])
            if i == c.num_hidden_layers - 1:
                ops.add_rms_norm(buf["h"], w[f"{layer}.mlp_out_norm"], eps,
                                 buf["residual_mid"], offset=offset, out=buf["residual"])
        else:
            ops.linear(buf["act"], w[f"{layer}.down"], buf["residual"], accumulate=True)

    def head(self, backend: Backend, meta, buf):
        """Only the last token of each sequence needs the final norm and the LM head: logits
        [B, V] float32. In a decode step every row is its sequence's last: nothing to gather."""
        c, ops, w = self.config, backend.ops, backend.weights
        last = buf["residual"]
        if not meta.is_decode_only:
            last = buf["last_residual"]
            ops.gather_rows(buf["residual"], meta.last_token_indices, last)
        lm_head = w["lm_head"] if "lm_head" in w else w["embed"]  # tied embeddings
        ops.norm_linear(last, w["final_norm"], c.rms_norm_eps, lm_head, buf["logits"],
                        buf["last_h"], offset=c.norm_offset)
        if c.final_logit_softcap is not None:
            ops.softcap(buf["logits"], c.final_logit_softcap)
        return buf["logits"]
